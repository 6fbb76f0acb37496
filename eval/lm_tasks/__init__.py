"""Local lm-eval task definitions (YAML) and the documents they read; `eval.lm_harness` includes them."""
