"""Language-model pipelines (GRPO): everything that is a language model pipeline's alone."""
