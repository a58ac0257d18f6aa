"""The gradbus config as the benchmark reads it: the TOML file over gradbus's defaults, then
`--set key=value` overrides with dotted keys and TOML values (a bare word is a string), as
`gradbus run ... --set` does. Standard library only, so the driver can use it without torch."""

import json
import tomllib

# Vocabulary of worker/src/task.rs.
BOS, EOS, PAD, FIRST = 0, 1, 2, 3

# The defaults of worker/src/config/mod.rs, model.rs and loss.rs for the keys the benchmark uses.
DEFAULTS = {
    "seed": 0,
    "device": "cpu",
    "steps": 20,
    "rollout_sync_interval": 1,
    "model": {"vocab": 16, "max_seq": 16, "channels": 64, "heads": 4, "layers": 2},
    "rl": {"prompts_per_rank": 2, "group_size": 8, "response_len": 8, "epochs": 4, "minibatches": 4,
           "temperature": 1.0},
    "loss": {"style": "roll", "clip": 0.2, "kl_coef": 0.01},
    "optim": {"lr": 1e-3, "warmup": 0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
              "grad_clip": 1.0},
}


def load_config(path, overrides=()):
    cfg = json.loads(json.dumps(DEFAULTS))
    with open(path, "rb") as f:
        text = tomllib.load(f)
    for k, v in text.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    for o in overrides:
        key, _, raw = o.partition("=")
        try:
            val = tomllib.loads(f"x = {raw}")["x"]
        except tomllib.TOMLDecodeError:
            val = raw
        *parents, last = key.strip().split(".")
        d = cfg
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = val
    return cfg


def tokens_per_update(cfg, ranks):
    """Tokens of one update summed over ranks: per-rank minibatch sequences x T x ranks, with
    T = response_len + 1 the positions the model reads per sequence."""
    rl = cfg["rl"]
    per_mb = rl["prompts_per_rank"] * rl["group_size"] // rl["minibatches"]
    return per_mb * (rl["response_len"] + 1) * ranks


def updates_per_step(cfg):
    return cfg["rl"]["epochs"] * cfg["rl"]["minibatches"]
