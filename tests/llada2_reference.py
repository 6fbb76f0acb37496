"""A plain float64 numpy oracle of LLaDA2 (`LLaDA2MoeModelLM`), written from the dllm library's modeling code
and its `LLaDA2Sampler` / `LLaDA21Sampler` (pipelines/llada2, pipelines/llada21 at 62ebe4f): the full window
recomputed every step under the block-causal mask (`tril` over blocks, its log added to the scores), no cache.
Independent of the package; slow and simple on purpose."""

from __future__ import annotations

import numpy as np


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def partial_rope(x, positions, theta, rotary):
    """x [B, H, T, hd]: the first `rotary` dims rotate-half rotated at absolute `positions`, the rest kept."""
    inv = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
    ang = np.concatenate([np.outer(positions, inv)] * 2, axis=-1)
    turned, kept = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rot = np.concatenate([-turned[..., half:], turned[..., :half]], axis=-1)
    return np.concatenate([turned * np.cos(ang) + rot * np.sin(ang), kept], axis=-1)


def swiglu(f, w, prefix):
    g = f @ w[prefix + "gate_proj.weight"].T
    return ((g / (1 + np.exp(-g))) * (f @ w[prefix + "up_proj.weight"].T)) @ w[prefix + "down_proj.weight"].T


def moe(f, w, cfg, prefix):
    """`LLaDA2MoeSparseMoeBlock` at inference: grouped sigmoid routing, weighted experts, the shared expert."""
    logits = f @ w[prefix + "gate.weight"].T
    scores = 1 / (1 + np.exp(-logits))
    biased = scores + w[prefix + "gate.expert_bias"]
    out = np.zeros_like(f)
    per_group = cfg.n_experts // cfg.expert_groups
    for index in np.ndindex(f.shape[:-1]):
        groups = biased[index].reshape(cfg.expert_groups, per_group)
        group_scores = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        kept = np.argsort(-group_scores, kind="stable")[: cfg.groups_kept]
        masked = np.full(cfg.n_experts, -np.inf)
        for group in kept:
            masked[group * per_group:(group + 1) * per_group] = groups[group]
        chosen = np.argsort(-masked, kind="stable")[: cfg.experts_per_token]
        weights = scores[index][chosen]
        if len(chosen) > 1:
            weights = weights / (weights.sum() + 1e-20)
        for expert, weight in zip(chosen, weights * cfg.routed_scaling):
            out[index] += weight * swiglu(f[index][None], w, f"{prefix}experts.{expert}.")[0]
    if cfg.shared_expert_size:
        out = out + swiglu(f, w, prefix + "shared_experts.")
    return out


def forward(w, cfg, ids, block_length, positions=None, visible=None):
    """Logits [B, T, E] of the window `ids` [B, T] under the block-causal mask of `block_length` blocks (or the
    [T, T] mask `visible`, at rotary `positions`)."""
    b, t = ids.shape
    h, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    blocks = np.arange(t) // block_length
    if visible is None:
        visible = blocks[None, :] <= blocks[:, None]
    positions = np.arange(t) if positions is None else positions
    with np.errstate(divide="ignore"):
        mask = np.log(visible.astype(np.float64))  # 0 visible, -inf hidden
    x = w["model.word_embeddings.weight"][ids]
    for layer in range(cfg.n_layers):
        p = f"model.layers.{layer}."
        a = rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        qkv = (a @ w[p + "attention.query_key_value.weight"].T).reshape(b, t, h + 2 * kh, hd)
        q, k, v = (part.transpose(0, 2, 1, 3) for part in np.split(qkv, [h, h + kh], axis=2))
        if cfg.qk_norm:
            q = rms(q, w[p + "attention.query_layernorm.weight"], cfg.rms_norm_eps)
            k = rms(k, w[p + "attention.key_layernorm.weight"], cfg.rms_norm_eps)
        q, k = (partial_rope(z, positions, cfg.rope_theta, cfg.rotary_width) for z in (q, k))
        k, v = np.repeat(k, h // kh, axis=1), np.repeat(v, h // kh, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(0, 2, 1, 3).reshape(b, t, -1) @ w[p + "attention.dense.weight"].T
        f = rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + (swiglu(f, w, p + "mlp.") if layer < cfg.dense_layers else moe(f, w, cfg, p + "mlp."))
    return rms(x, w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T


def forward_noised(w, cfg, noised, clean, block_length):
    """Logits [B, L, E] of `noised` [B, L] as block diffusion's training bound reads it (dllm's BD3LM eval): the
    2L tokens [noised ⊕ clean] at positions [0..L-1, 0..L-1]; a noised block sees itself and the clean blocks
    before it, a clean block the clean blocks up to itself; the noised half's logits."""
    length = noised.shape[1]
    blocks = np.arange(length) // block_length
    same, earlier = blocks[None, :] == blocks[:, None], blocks[None, :] < blocks[:, None]
    visible = np.block([[same, earlier], [np.zeros_like(same), same | earlier]])
    ids = np.concatenate([noised, clean], axis=1)
    positions = np.concatenate([np.arange(length)] * 2)
    return forward(w, cfg, ids, block_length, positions, visible)[:, :length]


def greedy(logits):
    """Temperature 0 as the samplers do it: the argmax and its softmax probability."""
    x0 = logits.argmax(-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return x0, np.take_along_axis(p, x0[..., None], -1)[..., 0]


def topk_positions(conf, k):
    return np.argsort(-conf, kind="stable")[:k]


def sample_llada2(w, cfg, prompt, max_new_tokens, block_size, steps_per_block, threshold=0.95, minimal_topk=1):
    """`LLaDA2Sampler.sample` at temperature 0 (no eos_early_stop): the canvas [T] and the forward passes."""
    mask_id, p_len = cfg.mask_token_id, len(prompt)
    steps_per_block = min(steps_per_block, max_new_tokens // minimal_topk)
    num_blocks = (p_len + max_new_tokens + block_size - 1) // block_size
    x = np.full(num_blocks * block_size, mask_id)
    x[:p_len] = prompt
    schedule = np.full(steps_per_block, block_size // steps_per_block)
    schedule[: block_size % steps_per_block] += 1
    nfe = 0
    for blk in range(p_len // block_size, num_blocks):
        end = (blk + 1) * block_size
        for step in range(steps_per_block):
            active = x[end - block_size:end] == mask_id
            if not active.any():
                break
            tokens, probs = greedy(forward(w, cfg, x[None, :end], block_size)[0, -block_size:])
            nfe += 1
            conf = np.where(active, probs, -np.inf)
            high = (conf > threshold) & active
            chosen = high.copy()
            if high.sum() < schedule[step]:
                chosen[:] = False
                if schedule[step] > 0 and active.any():
                    chosen[topk_positions(conf, min(schedule[step], active.sum()))] = True
            x[end - block_size:end][chosen] = tokens[chosen]
    return x, nfe


def sample_llada21(w, cfg, prompt, max_new_tokens, block_size, threshold=0.95, editing_threshold=0.9,
                   max_post_steps=16, num_to_transfer=1, give_up=200):
    """`LLaDA21Sampler.sample` at temperature 0 (no eos_early_stop): the canvas [T] and the forward passes, or
    None where a block passes `give_up` passes (its `while True` may never end: a mask predicted as itself)."""
    mask_id, p_len = cfg.mask_token_id, len(prompt)
    num_blocks = (p_len + max_new_tokens + block_size - 1) // block_size
    x = np.full(num_blocks * block_size, mask_id)
    x[:p_len] = prompt
    nfe = 0
    for blk in range(p_len // block_size, num_blocks):
        start, end = blk * block_size, (blk + 1) * block_size
        in_prompt = np.arange(start, end) < p_len
        post_steps = 0
        for _ in range(give_up + 1):
            old = x[start:end].copy()
            active = old == mask_id
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            tokens, probs = greedy(forward(w, cfg, x[None, :end], block_size)[0, -block_size:])
            nfe += 1
            commit = np.zeros(block_size, bool)
            if active.any():
                conf = np.where(active, probs, -np.inf)
                high = (conf > threshold) & active
                if high.sum() >= num_to_transfer:
                    commit = high
                else:
                    commit[topk_positions(conf, min(num_to_transfer, active.sum()))] = True
            edit = ~active & ~in_prompt & (probs > editing_threshold) & (tokens != old)
            x[start:end][commit | edit] = tokens[commit | edit]
            if not active.any() and not edit.any():
                break
        else:
            return None
    return x, nfe
