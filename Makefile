.PHONY: setup run test lint bench serve

setup:
	bash scripts/setup.sh

# Set up, then generate with speculation (ngram proposer, adaptive k policy, as `make serve`) on the embedded default model.
run: setup
	.venv/bin/specd generate --chat --stats --spec ngram --num-spec-tokens 8 --k-policy adaptive --max-tokens 128 \
	  "Rewrite this sentence in the passive voice: The quick brown fox jumps over the lazy dog."

# Set up, lint, then run the whole test suite (unit tests on tiny models + integration on the default model).
test: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/python -m pytest -q

serve: setup
	.venv/bin/specd serve --spec ngram --num-spec-tokens 8 --k-policy adaptive

lint:
	.venv/bin/ruff check src tests bench
