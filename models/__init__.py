"""The trained QA model shipped with the package (models/default: config, weights, tokenizer),
the default of every command's --model (services/runtime/modelzoo.py, default_model_dir)."""
