# The two commands a newcomer needs: `make demo` and `make test`.
VENV := .venv
BIN := $(VENV)/bin
export CARGO_TERM_PROGRESS_WHEN = never

.PHONY: demo test test-rust test-python lint develop test-long bench clean

$(VENV)/.installed: requirements-dev.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

# Builds the Rust engine and installs the Python package (and the `embank` command) into .venv.
develop: $(VENV)/.installed
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop --release --locked -q

# The main job: build a store of a few million rows, pull from it, reopen it.
demo: develop
	$(BIN)/embank demo

# Every check: formatting, lints with warnings denied, Rust tests, Python lint, types, tests.
test: develop lint test-rust test-python

lint: $(VENV)/.installed
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
	$(BIN)/ruff check python tests/python examples
	$(BIN)/ruff format --check python tests/python examples
	$(BIN)/mypy

test-rust:
	cargo test --workspace --exclude embank-py --locked
	cargo test -p embank-cli --features baselines --locked --test bench_smoke

test-python: develop
	$(BIN)/pytest -q

# The crash test with thousands of SIGKILLs (a few minutes).
test-long:
	EMBANK_CRASH_KILLS=3000 cargo test -p embank-core --release --locked --test crash -- --nocapture

# The bench with every baseline engine; pass arguments with ARGS="--workload ycsb-b ...".
bench:
	cargo build --release --locked -p embank-cli --features baselines
	target/release/embank bench $(ARGS)

clean:
	cargo clean
	rm -rf $(VENV)
