"""The one place that knows data/: prompts and chat templates, tasks, corpora, schemas."""
