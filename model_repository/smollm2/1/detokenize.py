"""Text from tokens as they are generated, a few tokens at a time (incremental detokenization).

A streamed answer sends, for each new token, the text it adds. Decoding the prompt and every token
so far at each step costs O(n) a token, O(n²) an answer. :class:`IncrementalText` decodes only a
window: the last few tokens whose text was already sent (their context: a word's leading space,
the bytes of a character split across tokens) and the tokens since. This is what vLLM's and TGI's
detokenizers do.

Its pieces join to the answer that ``protocol.completion`` decodes whole: text is sent only up to a
token where it ends on a complete character, and never taken back. A window whose text would
rewrite what was sent (a tokenizer whose decode of more tokens changes earlier text) sends nothing;
the tokens wait, and the streamer's final response carries what the whole decode adds. This file
imports only the standard library, so the tests load it by path outside Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 6  # sent tokens decoded again before the new ones (vLLM keeps 5)
INCOMPLETE = "\ufffd"  # what decode makes of a character whose bytes have not all arrived


class IncrementalText:
    """The text one prompt's new tokens add, piece by piece.

    ``decode(ids)`` is the tokenizer's decode (special tokens skipped), the one that
    ``protocol.completion`` uses. Call :meth:`piece` with all the tokens generated so far, each
    time some were added.
    """

    def __init__(self, prompt: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.prompt = list(prompt)
        self.decode = decode
        self.read = len(self.prompt)  # the tokens before this index have had their text sent
        self.start = max(self.read - CONTEXT_TOKENS, 0)  # where the decoded window begins

    def piece(self, new: Sequence[int]) -> str:
        """The text of the tokens since the last piece; "" while it ends in an incomplete
        character or would change text already sent."""
        window = self._tokens(self.start, new)
        sent = self.decode(window[: self.read - self.start])
        text = self.decode(window)
        if len(text) <= len(sent) or text.endswith(INCOMPLETE) or not text.startswith(sent):
            return ""
        self.start, self.read = self.read, len(self.prompt) + len(new)
        return text[len(sent) :]

    def _tokens(self, start: int, new: Sequence[int]) -> list[int]:
        """``(prompt + new)[start:]``, without copying the whole answer."""
        if start >= len(self.prompt):
            return list(new[start - len(self.prompt) :])
        return self.prompt[start:] + list(new)
