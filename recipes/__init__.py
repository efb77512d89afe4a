"""Command-line training recipes: `python -m recipes.llama3`, `python -m recipes.hf` (see `recipes.common`)."""
