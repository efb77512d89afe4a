"""Command-line training recipes: `python -m recipes.llama3`, `python -m recipes.hf` (a run top to bottom: `recipes.runner`; its flags: `recipes.flags`)."""
