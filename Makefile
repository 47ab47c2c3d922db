# The README's two commands: `make demo` runs the lab end to end, `make test` runs the tests.
# Each installs what it needs first. CI (.ci/run) runs `make test`.
.PHONY: install demo test test-loaded lint format bench soak image gpu-bundle clean

VENV := .venv
BIN := $(VENV)/bin

install:
	bash scripts/install.sh

demo: install
	$(BIN)/labkit run

test: install
	$(BIN)/ruff check labkit tests conftest.py
	$(BIN)/python -m pytest -p no:cacheprovider

# The integration and notebook tests while a spinning process holds one CPU core (tests/conftest.py,
# --busy-core): how a race that a loaded machine shows is found before CI finds it.
test-loaded: install
	$(BIN)/python -m pytest -p no:cacheprovider -m "integration or notebook" --busy-core

lint: install
	$(BIN)/ruff check labkit tests conftest.py
	$(BIN)/ruff format --check labkit tests conftest.py
	$(BIN)/hadolint docker/Dockerfile

format:
	$(BIN)/ruff format labkit tests

bench: install
	$(BIN)/labkit bench batching --json runs/bench-batching.json
	$(BIN)/labkit bench inflight --json runs/bench-inflight.json

soak: install
	$(BIN)/labkit bench soak --json runs/bench-soak.json
	$(BIN)/labkit bench inflight-soak --json runs/bench-inflight-soak.json

image: install
	$(BIN)/labkit image build

gpu-bundle: install
	bash scripts/gpu-check.sh --bundle runs/gpu-bundle

clean:
	rm -rf runs .pytest_cache
