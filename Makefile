# The two commands a newcomer needs: `make demo` and `make test`.
VENV := .venv
BIN := $(VENV)/bin
export CARGO_TERM_PROGRESS_WHEN = never

.PHONY: demo wheel test test-rust test-python lint lint-layers develop test-long bench clean fuzz fuzz-smoke fuzz-tools kafka-jars kge-data

# The demo's tools alone (maturin, numpy): what a newcomer's `make demo` installs.
$(VENV)/.demo-installed: requirements-demo.txt
	@python3 -c 'import venv, ensurepip' 2>/dev/null || { echo "make: python3 cannot make a venv with pip (Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-demo.txt
	touch $@

# The tests' tools besides: pytest, ruff, mypy, PyTorch (about 5 GB with its CUDA libraries),
# and TorchRec with FBGEMM's CPU kernels for the parity tests (without their dependencies,
# which would replace torch: requirements-torchrec.txt lists what they import).
$(VENV)/.installed: requirements-dev.txt requirements-torchrec.txt $(VENV)/.demo-installed
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-torchrec.txt
	touch $@

# Builds the Rust engine and installs the Python package (and the `embank` command) into .venv.
# `make test` builds it with the CPU emulator of the GPU cache's kernels (g++ needed), so that
# the native GPU path's Python tests run without a GPU; `make demo` builds it without.
# The `embank` command is a program of its own (crates/embank-cli), linked into the package
# as python/embank/bin/embank; the extension links no command line.
develop: $(VENV)/.demo-installed
	cargo build --release --locked -q -p embank-cli --bin embank
	mkdir -p python/embank/bin && ln -sfn ../../../target/release/embank python/embank/bin/embank
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop --release --locked -q $(DEVELOP_FLAGS)

# The main job: build a store of a few million rows, pull from it, reopen it.
demo: develop
	$(BIN)/embank demo

# One self-contained wheel (abi3: any CPython >= 3.9; manylinux_2_28: glibc >= 2.28),
# stripped, in dist/: `pip install dist/embank-*.whl` needs no Rust, compiler or system
# library.
# Zig (from PyPI) links it against glibc 2.28's symbols, whatever this machine's glibc:
# tools/wheel_linker.sh is the linker of the extension's last link alone, so the wheel
# reuses the crates `make demo` compiled (same target directory, flags and interpreter)
# and builds in seconds after it. maturin still checks the symbols against the tag.
WHEEL_COMPATIBILITY ?= manylinux_2_28
$(VENV)/.wheel-installed: requirements-wheel.txt $(VENV)/.demo-installed
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-wheel.txt
	touch $@

WHEEL_ENV = EMBANK_WHEEL_VENV=$(abspath $(VENV)) EMBANK_WHEEL_GLIBC=$(subst _,.,$(patsubst manylinux_%,%,$(WHEEL_COMPATIBILITY)))
wheel: $(VENV)/.wheel-installed
	rm -rf dist
	$(WHEEL_ENV) cargo rustc --release --locked -q -p embank-cli --bin embank -- -C linker=$(abspath tools/wheel_linker.sh) -C strip=symbols
	rm -f python/embank/bin/embank && install -D -m 755 target/release/embank python/embank/bin/embank
	$(WHEEL_ENV) $(BIN)/maturin build --release --locked -i $(abspath $(BIN))/python --compatibility $(WHEEL_COMPATIBILITY) -o dist \
	  -- -C linker=$(abspath tools/wheel_linker.sh)
	@ls -l dist

# Every check: formatting, lints with warnings denied, Rust tests, Python lint, types, tests,
# and a short run of every fuzz target.
test: develop $(VENV)/.installed lint test-rust test-python fuzz-smoke
test: DEVELOP_FLAGS = --features gpu-emulator

lint: $(VENV)/.installed
	cargo fmt --all --check
	python3 tools/import_cycles.py
	$(MAKE) -s lint-layers
	$(BIN)/python tools/gpu_ptx.py --check
	cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
	$(BIN)/ruff check python tests/python examples bench tools/newcomer.py
	$(BIN)/ruff format --check python tests/python examples bench tools/newcomer.py
	$(BIN)/mypy
	$(BIN)/mypy --strict tools/newcomer.py

# The Python extension links the engine only: the command line, plots and baselines are the
# embank program's (crates/embank-cli, crates/embank-bench).
lint-layers:
	@tree=$$(cargo tree --locked -p embank-py -e normal --prefix none) && ! echo "$$tree" | grep -E '^(embank-cli|embank-bench|clap|plotters|rcgen|heed|rocksdb) ' \
	  || { echo "make lint: embank-py (the extension) links the crates above; only the embank program may" >&2; exit 1; }

test-rust: kafka-jars
	cargo test --workspace --exclude embank-py --locked
	cargo test -p embank-gpu --features emulator --locked
	cargo test -p embank-cli --features baselines --locked --test bench_smoke

test-python: develop kge-data
	@$(BIN)/python -c 'import shutil, tempfile; t = tempfile.gettempdir(); print(f"pytest: {shutil.disk_usage(t).free / 2**30:.1f} GiB free in {t}")'
	$(BIN)/pytest -q

# The SIGKILL crash tests at 1,000 kills each (store on both media, the server process,
# training checkpoints, update-stream replicas on Kafka and Redis).
test-long:
	EMBANK_CRASH_KILLS=1000 cargo test -p embank-core --release --locked --test crash -- --nocapture
	EMBANK_SERVER_KILLS=1000 cargo test -p embank-cli --release --locked --test serve_crash -- --nocapture
	EMBANK_CKPT_KILLS=1000 cargo test -p embank-core --release --locked --test checkpoint sigkill -- --nocapture
	EMBANK_REPLICA_KILLS=1000 cargo test -p embank-cli --release --locked --test replica killed -- --nocapture --test-threads 1

# Coverage-guided fuzzing (libFuzzer through cargo fuzz, on the nightly toolchain beside
# stable): every target for FUZZ_SECONDS; corpora that find new coverage grow in
# fuzz/corpus/<target> (commit them), crashes land in fuzz/artifacts/<target>.
FUZZ_TARGETS := frame server config catalog checkpoints journal index rows stream
FUZZ_SECONDS ?= 300
CARGO_FUZZ_VERSION := 0.12.0

# cargo-fuzz itself builds on stable (its locked dependencies predate today's nightly).
fuzz-tools:
	@cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --version $(CARGO_FUZZ_VERSION) --locked

fuzz: fuzz-tools
	@set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus/$$t; \
	  cargo +nightly fuzz run $$t fuzz/corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 2>&1 \
	    | tee fuzz/last-$$t.log | grep -E "stat::number_of_executed_units|Done|ERROR|panicked" ; \
	  if grep -qE "ERROR: libFuzzer|panicked at" fuzz/last-$$t.log; then \
	    echo "fuzz-smoke: $$t failed (fuzz/last-$$t.log; the input is under fuzz/artifacts/$$t)" >&2; exit 1; fi; \
	done

# The short run `make test` does: each target for a few seconds from its committed
# corpus. What it finds goes to a scratch folder (removed after), so the tree stays
# clean; only `make fuzz` grows the committed corpora.
fuzz-smoke: fuzz-tools
	@set -e; scratch=$$(mktemp -d); trap 'rm -rf "$$scratch"' EXIT; \
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p "$$scratch/$$t"; \
	  cargo +nightly fuzz run $$t "$$scratch/$$t" fuzz/corpus/$$t -- -max_total_time=8 -print_final_stats=1 2>&1 \
	    | tee fuzz/last-$$t.log | grep -E "stat::number_of_executed_units|Done|ERROR|panicked" ; \
	  if grep -qE "ERROR: libFuzzer|panicked at" fuzz/last-$$t.log; then \
	    echo "fuzz-smoke: $$t failed (fuzz/last-$$t.log; the input is under fuzz/artifacts/$$t)" >&2; exit 1; fi; \
	done

# The bench with every baseline engine; pass arguments with ARGS="--workload ycsb-b ...".
bench:
	cargo build --release --locked -p embank-cli --features baselines
	target/release/embank bench $(ARGS)

clean:
	cargo clean
	rm -rf $(VENV) dist python/embank/bin

# The Kafka broker's jars (Maven Central) for the update-stream tests and bench-stream.
# The Nations and UMLS graphs of examples/kge (read out of the pykeen wheel on PyPI).
kge-data: tools/kge/data/.fetched
tools/kge/data/.fetched: tools/kge/fetch.py $(VENV)/.installed
	$(BIN)/python tools/kge/fetch.py

kafka-jars: tools/kafka/lib/.fetched
tools/kafka/lib/.fetched: tools/kafka/pom.xml
	cd tools/kafka && mvn -q -B dependency:copy-dependencies -DoutputDirectory=lib
	touch $@
