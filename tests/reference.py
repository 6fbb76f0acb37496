"""A plain float64 numpy oracle, written straight from the published semantics and independent of
the package: the HF forwards of LLaDA, Dream and LLaDA-MoE (K/V cached before rotary, as `modeling_llada`
caches them; names as each family's checkpoints spell them) and the decoding loops of LLaDA's `generate` and
Fast-dLLM's prefix / dual cache. Slow and simple on purpose."""

from __future__ import annotations

import numpy as np

P = "model.transformer."
GIVE_UP = 200  # passes in one block: past this the reference loop would never end (below)


class NeverEnds(Exception):
    """A reference loop that waits for a block to fill while the model predicts the mask token itself."""


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def rope(x, positions, theta):
    """x [B, H, T, hd] at absolute positions [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([np.outer(positions, inv)] * 2, axis=-1)
    half = hd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def layer_weights(w, cfg, layer):
    """`key -> array` of one layer, the keys LLaDA's checkpoints use, read under each family's own names."""
    family = getattr(cfg, "family", "llada")
    if family == "llada":
        return lambda key: w[f"{P}blocks.{layer}.{key}.weight"]
    qwen = {"attn_norm": "input_layernorm.weight", "attn_out": "self_attn.o_proj.weight",
            "ff_norm": "post_attention_layernorm.weight", "ff_proj": "mlp.gate_proj.weight",
            "up_proj": "mlp.up_proj.weight", "ff_out": "mlp.down_proj.weight", "router": "mlp.gate.weight"}
    for name in ("q", "k", "v"):
        qwen.update({f"{name}_proj": f"self_attn.{name}_proj.weight", f"{name}_bias": f"self_attn.{name}_proj.bias",
                     f"{name}_norm": f"self_attn.{name}_norm.weight"})
    return lambda key: w[f"model.layers.{layer}.{qwen.get(key, key)}"]


def top_weights(w, cfg):
    if getattr(cfg, "family", "llada") == "llada":
        return w[P + "wte.weight"], w[P + "ln_f.weight"], w[P + "ff_out.weight"]
    return w["model.embed_tokens.weight"], w["model.norm.weight"], w["lm_head.weight"]


def swiglu(f, gate, up, down):
    g = f @ gate.T
    return ((g / (1 + np.exp(-g))) * (f @ up.T)) @ down.T


def sparse_moe(f, g, cfg):
    """LLaDA-MoE's MLP: softmax over all experts, the top k kept unrenormalised, each token its experts' sum."""
    logits = f @ g("router").T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(f)
    for index in np.ndindex(f.shape[:-1]):
        for expert in np.argsort(-probs[index], kind="stable")[: cfg.experts_per_token]:
            e = f"mlp.experts.{expert}."
            out[index] += probs[index][expert] * swiglu(f[index][None], g(e + "gate_proj.weight"),
                                                        g(e + "up_proj.weight"), g(e + "down_proj.weight"))[0]
    return out


def forward(w, cfg, ids, past=None, replace=None):
    """Logits [B, T, E] and this call's pre-rotary K/V per layer.

    past: per layer (k, v) [B, Kh, P, hd] for positions 0..P-1. Without `replace` the new tokens sit at
    positions P..P+T-1 (prefix cache); with `replace=(start, end)` they replace slots start..end-1 of
    `past` (dual cache). Dream's logits come shifted: row i predicts position i+1 (`shifted`).
    """
    b, t = ids.shape
    h, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    embedding, final_norm, head = top_weights(w, cfg)
    x = embedding[ids]
    presents = []
    for layer in range(cfg.n_layers):
        g = layer_weights(w, cfg, layer)
        a = rms(x, g("attn_norm"), cfg.rms_norm_eps)
        q, k, v = (a @ g(f"{name}_proj").T + (g(f"{name}_bias") if getattr(cfg, "qkv_bias", False) else 0)
                   for name in ("q", "k", "v"))
        q = q.reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        k = k.reshape(b, t, kh, hd).transpose(0, 2, 1, 3)
        v = v.reshape(b, t, kh, hd).transpose(0, 2, 1, 3)
        if getattr(cfg, "qk_norm", False):
            q, k = rms(q, g("q_norm"), cfg.rms_norm_eps), rms(k, g("k_norm"), cfg.rms_norm_eps)
        presents.append((k, v))
        if past is None:
            keys, vals, qpos = k, v, np.arange(t)
        elif replace is None:
            pk, pv = past[layer]
            keys, vals = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)
            qpos = np.arange(pk.shape[2], pk.shape[2] + t)
        else:
            keys, vals = past[layer][0].copy(), past[layer][1].copy()
            keys[:, :, replace[0]:replace[1]], vals[:, :, replace[0]:replace[1]] = k, v
            qpos = np.arange(replace[0], replace[1])
        q = rope(q, qpos, cfg.rope_theta)
        keys = rope(keys, np.arange(keys.shape[2]), cfg.rope_theta)
        rep = h // kh
        keys, vals = np.repeat(keys, rep, axis=1), np.repeat(vals, rep, axis=1)
        s = q @ keys.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ vals
        x = x + o.transpose(0, 2, 1, 3).reshape(b, t, -1) @ g("attn_out").T
        f = rms(x, g("ff_norm"), cfg.rms_norm_eps)
        if getattr(cfg, "n_experts", 0):
            x = x + sparse_moe(f, g, cfg)
        else:
            x = x + swiglu(f, g("ff_proj"), g("up_proj"), g("ff_out"))
    logits = rms(x, final_norm, cfg.rms_norm_eps) @ head.T
    return (shifted(logits) if getattr(cfg, "logits_shift", False) else logits), presents


def shifted(logits):
    """Dream's `torch.cat([logits[:, :1], logits[:, :-1]], dim=1)`."""
    return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


def transfer_counts(n, steps):
    c = np.zeros(steps, int) + n // steps
    c[: n % steps] += 1
    return c


def pick(logits, candidates, k, threshold):
    """Reference commit choice among candidate positions (top-k, or Fast-dLLM's threshold rule)."""
    x0 = logits.argmax(-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    conf = np.where(candidates, np.take_along_axis(p, x0[:, None], -1)[:, 0], -np.inf)
    order = np.argsort(-conf, kind="stable")
    if threshold is None:
        chosen = order[:k]
    else:
        n = int(candidates.sum())
        chosen = [order[0]] + [i for i in order[1:n] if conf[i] >= threshold]
    return np.array(chosen, int), x0


def generate(w, cfg, prompt, gen_length, block_length, steps, policy="vanilla", threshold=None, cfg_scale=0.0):
    """Token ids of the generated part, and the number of forward passes (CFG: vanilla only)."""
    mask = cfg.mask_token_id
    x = np.concatenate([prompt, np.full(gen_length, mask)])[None]
    lp = len(prompt)
    nb = gen_length // block_length
    spb = steps // nb
    nfe = 0
    for blk in range(nb):
        s, e = lp + blk * block_length, lp + (blk + 1) * block_length
        counts = transfer_counts(int((x[0, s:e] == mask).sum()), spb)
        i = 0
        past = None
        while True:
            if i > GIVE_UP:
                raise NeverEnds
            if policy == "vanilla" and threshold is None and i >= spb:
                break
            if policy != "vanilla" or threshold is not None:
                if i > 0 and not (x[0, s:e] == mask).any():
                    break
            cand = np.zeros(x.shape[1], bool)
            cand[s:e] = x[0, s:e] == mask
            if policy == "vanilla" and cfg_scale > 0:
                unconditional = x.copy()
                unconditional[0, :lp] = mask
                both = forward(w, cfg, np.concatenate([x, unconditional]))[0]
                logits = both[1] + (cfg_scale + 1) * (both[0] - both[1])
                offset = 0
            elif policy == "vanilla" or i == 0:
                logits, presents = forward(w, cfg, x)
                logits = logits[0]
                if policy == "prefix-cache":
                    past = [(k[:, :, :s], v[:, :, :s]) for k, v in presents]
                elif policy == "dual-cache":
                    past = presents
                offset = 0
            elif policy == "prefix-cache":
                logits = forward(w, cfg, x[:, s:], past)[0][0]
                offset = s
            else:
                logits = forward(w, cfg, x[:, s:e], past, replace=(s, e))[0][0]
                offset = s
            nfe += 1
            sub = cand[offset: offset + logits.shape[0]]
            chosen, x0 = pick(logits, sub, counts[i] if i < spb else 0, threshold)
            x[0, offset + chosen] = x0[chosen]
            i += 1
    return x[0, lp:], nfe
