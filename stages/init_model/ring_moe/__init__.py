"""`ring_moe`: the pipeline's own small implementation of the paper's policy design (Ling 2.0,
arXiv 2510.18855): shared experts, sigmoid router scores with an expert-bias term used for
top-k selection only (aux-loss-free balancing, held fixed during RL).

The two modules here are Hugging Face *custom code*: `init_model` writes them next to the
weights with an `auto_map` in config.json, so every later load goes through
`trust_remote_code` exactly as a hub model with its own modelling code does. They import
only torch and transformers (and each other, relatively), because they run from a copy in
the model directory, outside this package."""
