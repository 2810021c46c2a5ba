"""TurboQuant-style vector quantization of K/V rows (reference, format, and decode attention).

Format of one row x in R^D (any leading dims [..., D]):
  norm = ||x||_2                          stored float16 [...]
  y    = R (x / norm)                     R: fixed random orthogonal D x D matrix from `seed`
                                          (Haar: QR of a seeded float64 Gaussian, sign-fixed)
  code_d = argmin_c |y_d - c|             c: the 2**bits Lloyd-Max centroids of N(0, 1/D)
                                          (each coordinate of a random rotation of a unit vector
                                          is ~N(0, 1/D)); stored with kernels.bitpack along D:
                                          packed uint8 [..., D*bits/8]
  dequant: x_hat = norm * R^T c[code]     (float32 math)
In code, with row vectors: y = x @ R.T / norm, x_hat = norm * (c[code] @ R).
Attention never needs R inside the kernel: q.k = (q R^T).(R k), so the kernel reads codes in the
rotated domain with a rotated query (and rotated tail) and rotates the output back once.
"""

from __future__ import annotations

import functools
import math

import torch

from ._dispatch import use_triton
from .attention import attention_ref_streamed, batched, block_tokens
from .bitpack import pack_bits_ref, pad_multiple
from .pack import unpack_bits_float


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


@functools.lru_cache(maxsize=None)
def lloyd_max_gaussian(bits: int, iters: int = 20000, tol: float = 1e-10) -> tuple[float, ...]:
    """Centroids (ascending) of the MSE-optimal 2**bits-level scalar quantizer of N(0, 1).

    Lloyd's fixed point, in float64: thresholds t_i = (c_i + c_{i+1}) / 2, and each centroid is
    the conditional mean of its cell (a, b]: c = (phi(a) - phi(b)) / (Phi(b) - Phi(a)).
    Starts from the N(0, 3) quantiles at (i + 1/2) / n (Panter-Dite companding). Known values: 1 bit +-0.7979,
    2 bits +-0.4528, +-1.5104.
    """
    _check_bits(bits)
    n = 1 << bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    # start from the asymptotically optimal (Panter-Dite) density ~ pdf^(1/3): quantiles of N(0, 3)
    c = math.sqrt(6.0) * torch.special.erfinv(2 * p - 1)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(iters):
        t = (c[:-1] + c[1:]) / 2
        a, b = torch.cat([-inf, t]), torch.cat([t, inf])
        pdf = lambda z: torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731 (0 at +-inf)
        mass = 0.5 * (torch.special.erfc(-b / math.sqrt(2)) - torch.special.erfc(-a / math.sqrt(2)))
        new = (pdf(a) - pdf(b)) / mass
        done = (new - c).abs().max().item() < tol
        c = new
        if done:
            break
    return tuple(c.tolist())


def turbo_codebook(bits: int, dim: int, device=None) -> torch.Tensor:
    """float32 [2**bits] centroids for N(0, 1/dim) coordinates (ascending)."""
    return torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float32, device=device) / math.sqrt(dim)


@functools.lru_cache(maxsize=None)
def _rotation_cpu(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r))).float()  # Haar-distributed orthogonal


def turbo_rotation(dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The fixed orthogonal float32 [dim, dim] matrix R for (dim, seed) (cached on CPU)."""
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    return _rotation_cpu(dim, seed).to(device)


def turbo_quantize(x: torch.Tensor, bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed codes uint8 [..., D*bits/8], norms float16 [...])."""
    _check_bits(bits)
    d = x.shape[-1]
    if d % pad_multiple(bits):
        raise ValueError(f"dim {d} does not pack into bytes at {bits} bits")
    xf = x.float()
    norm16 = xf.norm(dim=-1).to(torch.float16)
    norm = norm16.float().unsqueeze(-1)
    y = (xf / torch.where(norm == 0, torch.ones_like(norm), norm)) @ turbo_rotation(d, seed, x.device).T
    cb = turbo_codebook(bits, d, x.device)
    codes = torch.bucketize(y, (cb[:-1] + cb[1:]) / 2).to(torch.uint8)  # nearest centroid
    return pack_bits_ref(codes, bits), norm16


def turbo_dequantize_rotated(packed, norms, bits: int, dtype=torch.float32) -> torch.Tensor:
    """norm * c[code]: the rows in the rotated domain (what the attention kernel computes)."""
    _check_bits(bits)
    d = packed.shape[-1] * 8 // bits
    if tuple(norms.shape) != tuple(packed.shape[:-1]):
        raise ValueError(f"norms {tuple(norms.shape)} do not match packed {tuple(packed.shape)}")
    cb = turbo_codebook(bits, d, packed.device)
    return (unpack_bits_float(packed, bits, d, values=cb) * norms.float().unsqueeze(-1)).to(dtype)


def turbo_dequantize(packed, norms, bits: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Inverse of turbo_quantize: x_hat = norm * c[code] @ R -> [..., D] in dtype."""
    y = turbo_dequantize_rotated(packed, norms, bits)
    return (y @ turbo_rotation(y.shape[-1], seed, packed.device)).to(dtype)


def turbo_decode_attention_ref(
    q,
    k_packed,
    k_norm,
    v_packed,
    v_norm,
    *,
    bits: int,
    v_bits: int | None = None,
    seed: int = 0,
    v_seed: int | None = None,
    k_tail=None,
    v_tail=None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Reference, in the rotated domain: since R is orthogonal, q.k_hat = (q R^T).(norm c[code]) and
    sum_j p_j v_hat_j = (sum_j p_j norm_j c[code_j]) R, so rotate q and the tail by R^T, attend over
    norm * c[code] (decoded block by block, attention_ref_streamed) and rotate the output back by
    R. Equal up to fp32 rounding to dequantize-then-attend, without the T x D x D rotation of
    every cached row. Keys use R(seed), values R(v_seed) (default: seed): q and the tail keys are
    rotated by the first, the tail values and the output by the second."""
    v_bits = bits if v_bits is None else v_bits
    v_seed = seed if v_seed is None else v_seed
    had, q4, (kp, kn, vp, vn, kt, vt) = batched(q, k_packed, k_norm, v_packed, v_norm, k_tail, v_tail)
    b, hkv, t, _ = kp.shape
    if vp.shape[:3] != kp.shape[:3]:
        raise ValueError(f"k_packed {tuple(kp.shape)} and v_packed {tuple(vp.shape)} differ in [B, Hkv, T]")
    d = q4.shape[-1]
    rot, v_rot = turbo_rotation(d, seed, q.device), turbo_rotation(d, v_seed, q.device)

    def rotate(x, r=rot):
        return None if x is None else x.float() @ r.T

    def load_k(s, e):
        return turbo_dequantize_rotated(kp[..., s:e, :], kn[..., s:e], bits)

    def load_v(s, e):
        return turbo_dequantize_rotated(vp[..., s:e, :], vn[..., s:e], v_bits)

    out = attention_ref_streamed(
        rotate(q4), hkv, t, load_k, load_v, block_tokens(b, hkv, d, 1), rotate(kt), rotate(vt, v_rot), sm_scale
    )
    out = (out @ v_rot).to(q.dtype)
    return out if had else out.squeeze(0)


def turbo_decode_attention(
    q,
    k_packed,
    k_norm,
    v_packed,
    v_norm,
    *,
    bits: int,
    v_bits: int | None = None,
    seed: int = 0,
    v_seed: int | None = None,
    k_tail=None,
    v_tail=None,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of q [B?, Hq, Lq, D] over TurboQuant-coded K/V [B?, Hkv, T, D*bits/8] (+ norms
    [B?, Hkv, T]) and an optional full-precision tail; keys were coded with `seed`, values with
    `v_seed` (default: the same seed). -> [B?, Hq, Lq, D]."""
    v_bits = bits if v_bits is None else v_bits
    v_seed = seed if v_seed is None else v_seed
    _check_bits(bits)
    _check_bits(v_bits)
    d = q.shape[-1]
    if k_packed.shape[-1] * 8 != d * bits or v_packed.shape[-1] * 8 != d * v_bits:
        raise ValueError(
            f"packed K/V last dims {k_packed.shape[-1]}/{v_packed.shape[-1]} do not hold "
            f"head dim {d} at {bits}/{v_bits} bits"
        )
    if use_triton(backend, q, k_packed, v_packed, k_tail):
        from ._attn_triton import triton_supports, turbo_attention_triton

        if triton_supports(d, bits, v_bits):
            rot, v_rot = turbo_rotation(d, seed, q.device), turbo_rotation(d, v_seed, q.device)

            # rotate q and the tail into the code domains, attend, rotate the output back
            def rotate(x, r=rot):
                return None if x is None else (x.float() @ r.T).to(x.dtype)

            out = turbo_attention_triton(
                rotate(q),
                k_packed,
                k_norm,
                v_packed,
                v_norm,
                turbo_codebook(bits, d, q.device),
                turbo_codebook(v_bits, d, q.device),
                bits=bits,
                v_bits=v_bits,
                k_tail=rotate(k_tail),
                v_tail=rotate(v_tail, v_rot),
                sm_scale=sm_scale,
            )
            return (out.float() @ v_rot).to(q.dtype)
    return turbo_decode_attention_ref(
        q,
        k_packed,
        k_norm,
        v_packed,
        v_norm,
        bits=bits,
        v_bits=v_bits,
        seed=seed,
        v_seed=v_seed,
        k_tail=k_tail,
        v_tail=v_tail,
        sm_scale=sm_scale,
    )
