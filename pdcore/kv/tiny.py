"""A tiny seeded attention decoder in torch: real KV for the demo (``--model tiny``) and its tests.

No download: the weights come from a fixed seed. ``float64`` throughout so a
run split over tensor-parallel ranks (sums in another order) picks the same
greedy tokens as one process.

- ``Tiny(layout, seed)``: ``layout.layers`` layers; MHA with
  ``layout.kv_heads`` heads of ``head_bytes / 8`` elements for "hnd"/"nhd",
  or (``order="mla"``) a latent of ``head_bytes / 8`` elements per token from
  which every head's K and V are expanded (the cache holds only the latent,
  the same on every rank).
- ``prefill(prompt)``: the first token and the KV of every layer, all heads.
- ``write_pages(kv, heads, pages, caches)`` / ``read_pages(...)``: a rank's
  heads into (out of) its paged cache in the layout's page order.
- ``decode(kv_of_rank, first_token, steps, rank, tp, group)``: greedy
  decoding on decode rank ``rank`` of ``tp`` from only its heads' KV: each
  rank attends over its heads and the output projection is summed over the
  replica (``torch.distributed.all_reduce``; a head held by several ranks
  counts once). ``reference(prompt, steps)``: the same tokens in one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .layout import KvLayout

__all__ = ["Tiny", "VOCAB"]

VOCAB = 61
_D = 32  # model width
_FF = 64


class Tiny:
    def __init__(self, layout: KvLayout, seed: int = 0) -> None:
        if layout.head_bytes % 8:
            raise ValueError(f"the tiny model stores float64: head_bytes {layout.head_bytes} is not a multiple of 8")
        self.layout = layout
        self.mla = layout.order == "mla"
        self.width = layout.head_bytes // 8  # elements per head (MLA: of the latent)
        self.heads = 4 if self.mla else layout.kv_heads
        self.hd = 8 if self.mla else self.width
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5

        self.embed = w(VOCAB, _D) * VOCAB**0.5
        self.out = w(_D, VOCAB)
        self.layers = []
        for _ in range(layout.layers):
            layer = {"q": w(_D, self.heads * self.hd), "o": w(self.heads * self.hd, _D), "up": w(_D, _FF), "down": w(_FF, _D)}
            if self.mla:
                layer.update(c=w(_D, self.width), uk=w(self.width, self.heads * self.hd), uv=w(self.width, self.heads * self.hd))
            else:
                layer.update(k=w(_D, self.heads * self.hd), v=w(_D, self.heads * self.hd))
            self.layers.append(layer)

    # -- the math ---------------------------------------------------------------------------

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def _kv(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache stores for tokens ``h`` (normed): (K, V) as [tokens, heads, hd], or (latent, latent)."""
        if self.mla:
            c = h @ layer["c"]
            return c[:, None, :], c[:, None, :]
        n = h.shape[0]
        return (h @ layer["k"]).view(n, self.heads, self.hd), (h @ layer["v"]).view(n, self.heads, self.hd)

    def _expand(self, layer: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached entries → per-head K, V ([tokens, heads, hd])."""
        if not self.mla:
            return k, v
        n = k.shape[0]
        return (k[:, 0] @ layer["uk"]).view(n, self.heads, self.hd), (v[:, 0] @ layer["uv"]).view(n, self.heads, self.hd)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int) -> torch.Tensor:
        """q [n, h, hd] over k, v [t, h, hd]; query i sees keys ``< causal_from + i + 1``."""
        scores = torch.einsum("nhd,thd->hnt", q, k) / self.hd**0.5
        n, t = q.shape[0], k.shape[0]
        mask = torch.arange(t)[None, :] > (causal_from + torch.arange(n))[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        return torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v)

    def _step(self, tokens: torch.Tensor, caches: list[list[torch.Tensor]], heads: range,
              weight: torch.Tensor, group: Any) -> torch.Tensor:
        """One forward pass of ``tokens`` appended to ``caches`` (per layer [K, V] of ``heads``); the hidden states."""
        x = self.embed[tokens]
        past = caches[0][0].shape[0] if caches and caches[0] else 0
        for layer, cache in zip(self.layers, caches):
            h = self._norm(x)
            k, v = self._kv(layer, h)
            if not self.mla:
                k, v = k[:, heads.start : heads.stop], v[:, heads.start : heads.stop]
            if cache:
                cache[0], cache[1] = torch.cat([cache[0], k]), torch.cat([cache[1], v])
            else:
                cache += [k, v]
            kk, vv = self._expand(layer, cache[0], cache[1])
            q = (h @ layer["q"]).view(-1, self.heads, self.hd)
            if self.mla:
                qh, kk, vv, rows = q, kk, vv, slice(None)
            else:
                qh, rows = q[:, heads.start : heads.stop], slice(heads.start * self.hd, heads.stop * self.hd)
            att = self._attend(qh, kk, vv, past)
            o = att.reshape(att.shape[0], -1) @ layer["o"][rows] * weight
            if group is not None:
                torch.distributed.all_reduce(o, group=group)
            x = x + o
            x = x + torch.relu(self._norm(x) @ layer["up"]) @ layer["down"]
        return x

    def _next(self, x: torch.Tensor) -> int:
        return int(torch.argmax(self._norm(x[-1]) @ self.out))

    # -- what the demo calls ----------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        """The first token, and per layer (K, V) of every prompt token as [tokens, heads, width] float64."""
        caches: list[list[torch.Tensor]] = [[] for _ in self.layers]
        all_heads = range(0, 1 if self.mla else self.heads)
        x = self._step(torch.tensor(prompt), caches, all_heads, torch.tensor(1.0, dtype=torch.float64), None)
        return self._next(x), [(k.numpy(), v.numpy()) for k, v in caches]

    def reference(self, prompt: list[int], steps: int) -> list[int]:
        """Greedy tokens (the first included) of one process holding every head."""
        caches: list[list[torch.Tensor]] = [[] for _ in self.layers]
        all_heads = range(0, 1 if self.mla else self.heads)
        one = torch.tensor(1.0, dtype=torch.float64)
        tokens = [self._next(self._step(torch.tensor(prompt), caches, all_heads, one, None))]
        while len(tokens) < steps:
            tokens.append(self._next(self._step(torch.tensor(tokens[-1:]), caches, all_heads, one, None)))
        return tokens

    def decode(self, kv: list[tuple[np.ndarray, np.ndarray]], first_token: int, steps: int, rank: int, tp: int,
               group: Any) -> list[int]:
        """Greedy tokens from ``first_token`` on decode rank ``rank`` of ``tp``, from its heads' KV only."""
        first, count = self.layout.heads(rank, tp)
        if self.mla:
            heads, weight = range(0, 1), 1.0 / tp if group is not None else 1.0  # every rank holds all: sum / tp
        else:
            holders = [r for r in range(tp) if self.layout.heads(r, tp)[0] == first]
            heads, weight = range(first, first + count), 1.0 if rank == holders[0] else 0.0  # a head counts once
        caches = [[torch.from_numpy(np.ascontiguousarray(k)), torch.from_numpy(np.ascontiguousarray(v))] for k, v in kv]
        w = torch.tensor(weight, dtype=torch.float64)
        tokens = [first_token]
        while len(tokens) < steps:
            tokens.append(self._next(self._step(torch.tensor(tokens[-1:]), caches, heads, w, group)))
        return tokens

    # -- pages --------------------------------------------------------------------------------

    def _page_view(self, cache: np.ndarray, tp: int) -> np.ndarray:
        """One buffer as [pages, page_tokens, local heads, width] in token-major terms (a view)."""
        layout = self.layout
        _, count = layout.heads(0, tp)
        count = 1 if self.mla else count
        pages = cache.view(np.float64).reshape(-1, *((count, layout.page_tokens) if layout.order == "hnd"
                                                     else (layout.page_tokens, count)), self.width)
        return pages.transpose(0, 2, 1, 3) if layout.order == "hnd" else pages

    def write_pages(self, kv: list[tuple[np.ndarray, np.ndarray]], rank: int, tp: int, pages: list[int],
                    caches: list[np.ndarray]) -> None:
        """Rank ``rank``'s heads of ``kv`` (all heads) into ``pages`` of its buffers (K of layer l in buffer 2l)."""
        first, count = self.layout.heads(rank, tp)
        sel = slice(0, 1) if self.mla else slice(first, first + count)
        for buf, arr in zip(caches, [a for pair in kv for a in (pair[:1] if self.mla else pair)]):
            view = self._page_view(buf, tp)
            for i, page in enumerate(pages):
                chunk = arr[i * self.layout.page_tokens : (i + 1) * self.layout.page_tokens, sel]
                view[page, : chunk.shape[0]] = chunk

    def read_pages(self, rank: int, tp: int, pages: list[int], tokens: int,
                   caches: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rank ``rank``'s KV of ``tokens`` prompt tokens out of ``pages`` (the inverse of ``write_pages``)."""
        arrays = []
        for buf in caches:
            view = self._page_view(buf, tp)
            arrays.append(np.concatenate([view[p] for p in pages])[:tokens].copy())
        if self.mla:
            return [(a, a) for a in arrays]
        return list(zip(arrays[0::2], arrays[1::2]))
