"""BAGEL's loops over one resident network: AR decode (``chat``, the thinking of ``think-t2i``) and
image denoise (``t2i``, ``edit``, the image of ``think-t2i``).

A request's context is a list of segments appended to its KV cache in order: a text segment is
``<|im_start|> text <|im_end|>`` (causal, one RoPE position per token), an understanding image is
``<|vision_start|> ViT tokens <|vision_end|>`` and an edited image ``<|vision_start|> clean latent
tokens <|vision_end|>`` (bidirectional inside, every token at one RoPE position, which then advances
by one). Each segment is one prefill WorkUnit. The keys/values live in the instance's paged KV pool
(:mod:`fv_core.kv`): the request's LoopState holds its page lists, a step gathers its padded inputs
from the pool (bodies stay pure functions of their inputs), ``advance`` writes the request's own
pages, and ``finalize`` / ``release`` (cancel, failure) give them back. Each loop's ``kv_need`` tells
admission the most pages the request can hold at once, so a request waits for pages instead of
running out of them mid-decode.

AR decode: each token step feeds the last token at the next position and appends its keys/values;
sampling (greedy / temperature / top-k / top-p), EOS, stop strings and ``max_tokens`` run in
``advance`` on the request's own generator. Token steps of different requests batch as rows
whatever their context lengths: each row's context is padded to a power-of-two bucket (``BUCKET``)
with its real tokens marked, and the rows of one call to the longest (``WorkPlan.ragged``).

Denoise: ``<|vision_start|> latents <|vision_end|>`` is a query over the context that attends to
it and to itself in full and is never written to the cache (the prefix is reused by every step).
The latent tokens run on the generation expert, the two markers on the understanding expert.
CFG runs the same query over the text-unconditioned and image-unconditioned contexts, as extra
rows of the step (contexts with a common prefix share its pages); the guided velocity, its renorm
and the Euler update run in ``advance``.

Weight sync: a request pins the instance's weights versions (``net``, ``vae``) at init, ``think-t2i``'s
denoise stage those its AR stage pinned (``Request.carry``), and runs every plan (prefills, token steps,
denoise rows, the VAE) on those modules (``instance.component(name, version)``). The versions are part
of the batch keys, so requests on old and new weights never share a call, and keys/values are read only
under the ``net`` version that wrote them: contexts handed to a later stage name it, and a stage pinned
to another version refuses them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from fv_bagel.model import BagelModel
from fv_bagel.mot import grid_ids, linear
from fv_bagel.params import EditParams, GuidedParams, ImageParams, TextParams
from fv_core import (
    BatchKey,
    ConfigError,
    Done,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
)
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.request import NoiseDraws

RAGGED_CONTEXT = {"ctx_k": 3, "ctx_v": 3, "ctx_valid": 1}  # padded context inputs: rows differ in length
BUCKET = 16  # smallest padded context length of a step's inputs (then powers of two: ragged rows batch)

VLM_THINK_SYSTEM_PROMPT = (  # BAGEL's system prompts for thinking (inferencer.py)
    "You should first think about the reasoning process in the mind and then provide the user with the answer. \n"
    "The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning process here </think> "
    "answer here"
)
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
    "image here"
)


# ---- step bodies: pure functions of their inputs over the shared network ----


def text_body(net: Any, exact: bool, causal: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """A block of tokens per row over its context: its keys/values and the next-token logits."""
    ids = inputs["ids"]
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=ids.device)
    mask = mask.tril() if causal else mask
    lm = net.language_model
    h, k, v = lm(
        net.embed_tokens(ids),
        inputs["pos"],
        mask,
        inputs["ctx_k"],
        inputs["ctx_v"],
        inputs["ctx_valid"],
        exact=exact,
    )
    return {"k": k, "v": v, "logits": linear(h[:, -1], lm.lm_head, exact)}


def vit_body(net: Any, exact: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """One image for understanding: SigLIP tokens between the vision markers, prefilled in full attention."""
    markers = net.embed_tokens(inputs["ids"])  # [1, 2]
    vit = net.vit_embeds(inputs["patches"][0], inputs["vit_ids"][0])[None].to(markers.dtype)
    h = torch.cat([markers[:, :1], vit, markers[:, 1:]], dim=1)
    mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device)
    _, k, v = net.language_model(
        h, inputs["pos"], mask, inputs["ctx_k"], inputs["ctx_v"], inputs["ctx_valid"], exact=exact
    )
    return {"k": k, "v": v}


def denoise_body(net: Any, exact: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """Velocity of the latent tokens ``[R, N, p*p*C]`` at flow time ``t`` over each row's context, and
    the block's keys/values (a denoise step drops them; a clean image at ``t = 0`` appends them)."""
    x, t = inputs["latents"], inputs["t"]
    markers = net.embed_tokens(inputs["ids"])  # [R, 2]
    lat = net.latent_embeds(x, t, inputs["grid"][0], exact).to(markers.dtype)
    h = torch.cat([markers[:, :1], lat, markers[:, 1:]], dim=1)
    n = h.shape[1]
    gen = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
    gen[:, 1:-1] = True
    mask = torch.ones(n, n, dtype=torch.bool, device=h.device)
    out, k, v = net.language_model(
        h, inputs["pos"], mask, inputs["ctx_k"], inputs["ctx_v"], inputs["ctx_valid"], gen=gen, exact=exact
    )
    return {"velocity": linear(out[:, 1:-1], net.llm2vae, exact).float(), "k": k, "v": v}


def encode_body(vae: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Images ``[B, 3, H, W]`` in -1..1 to FLUX latents, a draw from the posterior with the given noise
    (BAGEL's encode samples), normalised as BAGEL does: ``scale * (z - shift)``."""
    dist = vae.encode(inputs["pixels"].to(vae.dtype)).latent_dist
    z = dist.mean + dist.std * inputs["noise"].to(vae.dtype)
    return {"latent": ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()}


def decode_body(vae: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """FLUX latents ``[B, C, h, w]`` to images ``[B, H, W, 3]`` in 0..1 (BAGEL's decode_image)."""
    z = inputs["latents"].to(vae.dtype)
    image = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample
    return {"frames": (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float()}


# ---- context helpers ----


def bucket(length: int) -> int:
    """The padded context length of a step: the next power of two from ``BUCKET`` (few distinct shapes)."""
    size = BUCKET
    while size < length:
        size *= 2
    return size


def padded(contexts: list[dict[str, Any]], size: int) -> dict[str, torch.Tensor]:
    """Rows' contexts as step inputs: keys/values ``[R, layers, kvh, size, d]`` and the real-token mask."""
    ks, vs, valid = [], [], []
    for ctx in contexts:
        k, v = ctx["k"], ctx["v"]
        pad = size - k.shape[2]
        ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
        vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
        valid.append(torch.arange(size, device=k.device) < k.shape[2])
    return {"ctx_k": torch.stack(ks), "ctx_v": torch.stack(vs), "ctx_valid": torch.stack(valid)}


def text_ids(inst: BagelModel, text: str) -> list[int]:
    """A text segment as BAGEL prefills it: ``<|im_start|> tokens <|im_end|>``."""
    sp = inst.special
    return [sp["bos_token_id"], *inst.tokenizer.encode(text), sp["eos_token_id"]]


def resized(image: np.ndarray, max_size: int, min_size: int, stride: int) -> torch.Tensor:
    """BAGEL's resize: the long side at most ``max_size``, the short side at least ``min_size``, both
    multiples of ``stride`` (bicubic, as its transforms run); returns ``[H, W, 3]`` in -1..1."""
    from PIL import Image

    height, width = image.shape[:2]
    scale = min(max_size / max(width, height), 1.0)
    scale = max(scale, min_size / min(width, height))

    def fit(value: float) -> int:
        return max(stride, int(round(value / stride) * stride))

    new_w, new_h = fit(round(width * scale)), fit(round(height * scale))
    if max(new_w, new_h) > max_size:
        s = max_size / max(new_w, new_h)
        new_w, new_h = fit(round(new_w * s)), fit(round(new_h * s))
    pil = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).resize(
        (new_w, new_h), Image.Resampling.BICUBIC
    )
    return torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0) * 2 - 1


def vit_patches(inst: BagelModel, net: Any, image: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """An image ``[H, W, 3]`` in 0..1 as SigLIP NaViT patches: resized so its long side is at most the
    tower's table and its short side at least 16 patches (both multiples of the patch), normalized to
    -1..1; returns patches ``[N, p*p*3]`` (row-major, each ``p x p x 3``) and their flattened ids."""
    p, side = net.vit_model.config.patch_size, net.vit_side
    pixels = resized(image, side * p, min(16 * p, side * p // 2), p)
    rows, cols = pixels.shape[0] // p, pixels.shape[1] // p
    patches = pixels.reshape(rows, p, cols, p, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    return patches.to(inst.device, inst.dtype), grid_ids(rows, cols, side).to(inst.device)


def _check_request(inst: BagelModel, request: Any, cls: type) -> Any:
    p = request.params
    if not isinstance(p, cls):
        raise ConfigError(
            f"request {request.request_id!r} carries {type(p).__name__} params, not {cls.__name__}. "
            "Fix: build requests with LoadedModel.prepare (fv_core.load(...).prepare(...))."
        )
    return p


def _check_positions(net: Any, needed: int, what: str) -> None:
    limit = net.language_model.config.max_position_embeddings
    if needed > limit:
        raise ConfigError(
            f"{what} needs {needed} positions; this model has {limit}. Fix: shorten the prompt or lower max_tokens.",
            param="prompt",
        )


def written(out: dict[str, Any], segment: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values a step wrote for its row's own tokens: a text ``segment``'s block, padded in a
    ragged batch, is cut back to its tokens; other blocks are kept whole."""
    k, v = out["k"][0], out["v"][0]
    if segment is None or segment["kind"] != "text":
        return k, v
    n = len(segment["ids"])
    return k[..., :n, :], v[..., :n, :]


def _plain(seq: KVSeq) -> dict[str, Any]:
    """A pool sequence as LoopState values hold it (plain data)."""
    return {"pages": list(seq.pages), "length": seq.length}


def _plan_inputs(contexts: list[dict[str, Any]], **tensors: torch.Tensor) -> dict[str, Any]:
    """Step inputs over contexts held as tensors (``k``, ``v``) or as a sequence in a KV pool (``seq``)."""
    if "seq" in contexts[0]:
        seqs = [KVSeq(**c["seq"]) for c in contexts]
        return {**tensors, **contexts[0]["pool"].gather(seqs, bucket(max(s.length for s in seqs)))}
    size = bucket(max(c["k"].shape[2] for c in contexts))
    return {**tensors, **padded(contexts, size)}


def _check_written_by(request: Any, net: str | None) -> None:
    """Keys/values handed over by an earlier stage are read only under the ``net`` version that wrote
    them (another version's would condition this stage on activations its weights never made)."""
    for context in request.carry.get("contexts", []):
        if context.get("net") != net:
            raise ConfigError(
                f"request {request.request_id!r} was handed keys/values written by net version "
                f"{context.get('net')!r}, but this stage runs on {net!r}: a stage reads only the keys/values "
                "of the weights it runs on. Fix: pass the earlier stage's weights_versions in the carry "
                "(as fv_bagel.program does), or run the request again."
            )


class _Base:
    def __init__(self, instance: BagelModel) -> None:
        self.instance = instance

    def _key(self, state: LoopState, kind: str, shape: tuple, component: str = "net") -> BatchKey:
        """Batch key of a plan on the request's pinned ``component``: plans on other weights versions
        (a weight sync between two requests' starts) never share a call."""
        inst = self.instance
        on = f"{inst.instance_id}@{self._pin(state, component)}" + (
            "" if component == "net" else f"/{component}"
        )
        return BatchKey(on, kind, shape, inst.precision, graph_key="exact" if inst.exact else "")

    @staticmethod
    def _pins(request: Any, inst: BagelModel) -> dict[str, str]:
        """The weights versions a request runs on to the end: a later program stage's are those its
        first stage pinned (they wrote the keys/values it is handed), else the instance's live ones."""
        return dict(request.carry.get("weights_versions") or inst.weights_versions)

    @staticmethod
    def _pin(state: LoopState, component: str) -> str | None:
        """The version of ``component`` the request pinned at init (None: a component without weights
        versions, e.g. a folder without ``ae.safetensors``: the live one)."""
        return state.values["weights_versions"].get(component)

    def _module(self, state: LoopState, component: str) -> Any:
        """``component`` on the weights the request pinned (a weight sync since leaves it on them)."""
        return self.instance.component(component, self._pin(state, component))

    def _net(self, state: LoopState) -> Any:
        return self._module(state, "net")

    def _segment_plan(self, ctx: dict[str, Any], segment: dict[str, Any], state: LoopState) -> WorkPlan:
        """The prefill WorkUnit of one context segment (a text or an understanding image)."""
        inst = self.instance
        net = self._net(state)
        dev = inst.device
        if segment["kind"] == "text":
            ids = torch.tensor([segment["ids"]], device=dev)
            pos = ctx["rope"] + torch.arange(ids.shape[1], device=dev)[None]
            return WorkPlan(
                kind=WorkUnitKind.AR_PREFILL,
                body=partial(text_body, net, inst.exact, True),
                inputs=_plan_inputs([ctx], ids=ids, pos=pos),
                # texts of any lengths share a call: each row's block padded at its end (causal: its
                # tokens never see the padding; advance keeps only its own tokens' keys/values)
                batch_key=self._key(state, "ar_prefill", ()),
                ragged={"ids": 1, "pos": 1, **RAGGED_CONTEXT},
                label=f"prefill {ids.shape[1]} tokens",
            )
        if segment["kind"] == "vae":
            return self._vae_segment_plan(ctx, state)
        patches = state.tensors[f"image{segment['index']}.patches"]
        vit = state.tensors[f"image{segment['index']}.ids"]
        sp = inst.special
        ids = torch.tensor([[sp["start_of_image"], sp["end_of_image"]]], device=dev)
        pos = torch.full((1, patches.shape[0] + 2), ctx["rope"], device=dev)
        return WorkPlan(
            kind=WorkUnitKind.ENCODER_CHUNK,
            body=partial(vit_body, net, inst.exact),
            inputs=_plan_inputs([ctx], ids=ids, pos=pos, patches=patches[None], vit_ids=vit[None]),
            label=f"image {patches.shape[0]} ViT tokens",
        )

    def _vae_segment_plan(self, ctx: dict[str, Any], state: LoopState) -> WorkPlan:
        """The edited image: its FLUX encode (VAE_TILE), then its clean latent tokens (flow time 0, the
        generation expert) between the vision markers, prefilled in full attention."""
        inst = self.instance
        if "edit.latent" not in state.tensors:
            vae = self._module(state, "vae")
            return WorkPlan(
                kind=WorkUnitKind.VAE_TILE,
                body=partial(encode_body, vae),
                inputs={"pixels": state.tensors["edit.pixels"], "noise": state.tensors["edit.noise"]},
                label="vae encode",
            )
        latent, n = state.tensors["edit.latent"], state.tensors["edit.latent"].shape[0]
        sp, dev = inst.special, inst.device
        inputs = _plan_inputs(
            [ctx],
            latents=latent[None].to(inst.dtype),
            t=torch.zeros(1, device=dev),
            ids=torch.tensor([[sp["start_of_image"], sp["end_of_image"]]], device=dev),
            grid=state.tensors["grid"][None],
            pos=torch.full((1, n + 2), ctx["rope"], device=dev),
        )
        return WorkPlan(
            kind=WorkUnitKind.AR_PREFILL,
            body=partial(denoise_body, self._net(state), inst.exact),
            inputs=inputs,
            label=f"image {n} latent tokens",
        )

    @staticmethod
    def _tokens(state: LoopState, segment: dict[str, Any]) -> int:
        """Tokens a segment writes to its context (an image: its tokens between the two vision markers)."""
        if segment["kind"] == "text":
            return len(segment["ids"])
        if segment["kind"] == "vae":
            rows, cols = state.values["grid_shape"]
            return 2 + rows * cols
        return 2 + len(state.tensors[f"image{segment['index']}.ids"])

    def _add_parts(self, state: LoopState, request: Any) -> list[dict[str, Any]]:
        """The request's text and image parts as context segments, in order (a conversation so far:
        BAGEL's interleaved input has no roles, each text is one ``<|im_start|> ... <|im_end|>`` span)."""
        segments: list[dict[str, Any]] = []
        images = 0
        for part in request.parts:
            if part.kind == "text":
                segments.append({"kind": "text", "ids": text_ids(self.instance, part.text)})
                continue
            patches, ids = vit_patches(self.instance, self._net(state), part.image)
            state.tensors[f"image{images}.patches"], state.tensors[f"image{images}.ids"] = patches, ids
            segments.append({"kind": "image", "index": images})
            images += 1
        return segments


class ChatLoop(_Base):
    """AR decode (task ``chat``): prefill the images and the prompt, then one token per step."""

    def init(self, request: Any, instance: Any = None, ctx: Any = None) -> LoopState:
        inst = self.instance
        p = _check_request(inst, request, TextParams)
        segments = []
        system = request.carry.get("system_prompt") or (VLM_THINK_SYSTEM_PROMPT if p.think else None)
        if system:
            segments.append({"kind": "text", "ids": text_ids(inst, system)})
        state = LoopState(
            request_id=request.request_id,
            loop_id=inst.card.programs[request.task].stages[0],
            generator=torch.Generator(device="cpu").manual_seed(p.seed),
        )
        state.values["weights_versions"] = self._pins(request, inst)  # first: every plan runs on these
        segments += self._add_parts(state, request)
        segments.append({"kind": "text", "ids": text_ids(inst, p.prompt)})
        prefix = sum(self._tokens(state, s) for s in segments)
        _check_positions(
            self._net(state),
            prefix + p.max_tokens + 1,
            f"a prompt of {prefix} tokens plus max_tokens={p.max_tokens}",
        )
        state.values.update(
            segments=segments,
            token=inst.special["bos_token_id"],  # the first decode step feeds <|im_start|>
            generated=[],
            text="",
            stop_reason=None,
            sampling=dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k),
            max_tokens=p.max_tokens,
            stop=list(p.stop),
            keep_contexts=bool(request.carry.get("keep_contexts")),
            streamed=0,
            kept=[],  # forks of the context after each segment, handed to a later stage (keep_contexts)
        )
        state.values.update(seq={"pages": [], "length": 0}, rope=0)  # the context: pages of the KV pool
        return state

    def _ctx(self, state: LoopState) -> dict[str, Any]:
        return {"seq": state.values["seq"], "pool": self.instance.kv_pool, "rope": state.values["rope"]}

    def _append(
        self, state: LoopState, out: dict[str, Any], rope_advance: int, segment: dict[str, Any] | None = None
    ) -> None:
        """Write a block's keys/values after the context (into this request's own pages)."""
        seq = self.instance.kv_pool.append(KVSeq(**state.values["seq"]), *written(out, segment))
        state.values["seq"] = {"pages": seq.pages, "length": seq.length}
        state.values["rope"] += rope_advance

    def kv_need(self, state: LoopState) -> tuple[PagedKVPool, int]:
        """The pool and the most pages this request holds at once: its context at its longest (the pending
        segments, then a token per step up to ``max_tokens``), plus one page per context kept for a later
        stage (a kept fork keeps the partly filled page the growing context then copies)."""
        pool, v = self.instance.kv_pool, state.values
        left = sum(self._tokens(state, s) for s in v["segments"])
        if v["stop_reason"] is None:
            left += v["max_tokens"] - len(v["generated"])
        forks = len(v["kept"]) + len(v["segments"]) if v["keep_contexts"] else 0
        return pool, pool.pages_for(v["seq"]["length"] + left) + forks

    def release(self, state: LoopState) -> None:
        """Return the context's pages to the pool (on finish, and when the request is cancelled or fails)."""
        pool, seq = self.instance.kv_pool, state.values.get("seq")
        if seq:
            pool.release(KVSeq(**seq))
            state.values["seq"] = None
        for kept in state.values.get("kept", []):
            pool.release(KVSeq(**kept["seq"]))
        state.values["kept"] = []

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.values["segments"]:
            return self._segment_plan(self._ctx(state), state.values["segments"][0], state)
        if state.values["stop_reason"] is not None:
            return Done(state.values["stop_reason"])
        inst, ctx = self.instance, self._ctx(state)
        dev = inst.device
        ids = torch.tensor([[state.values["token"]]], device=dev)
        pos = torch.tensor([[ctx["rope"]]], device=dev)
        inputs = _plan_inputs([ctx], ids=ids, pos=pos)
        return WorkPlan(
            kind=WorkUnitKind.AR_TOKEN,
            body=partial(text_body, self._net(state), inst.exact, True),
            inputs=inputs,
            # any context lengths share a call: padded to the longest
            batch_key=self._key(state, "ar_decode", ()),
            ragged=RAGGED_CONTEXT,
            emits=("progress", "partial"),
            label=f"token {len(state.values['generated']) + 1}",
        )

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out = result.outputs
        if state.values["segments"]:
            segment = state.values["segments"].pop(0)
            self._append(state, out, len(segment["ids"]) if segment["kind"] == "text" else 1, segment)
            if state.values["keep_contexts"]:  # a later stage reuses the context after each segment
                fork = self.instance.kv_pool.fork(KVSeq(**state.values["seq"]))
                # with the net version that wrote it: only a stage on that version may read it
                net = self._pin(state, "net")
                state.values["kept"].append({"seq": _plain(fork), "rope": state.values["rope"], "net": net})
            return state
        self._append(state, out, 1)
        state.step += 1
        assert state.generator is not None, "init seeds the request's generator"
        token = sample(out["logits"][0].float(), state.generator, **state.values["sampling"])
        self._take(state, token)
        # the step's stream payload (its "partial" event): the token and the text it settled; the
        # logits and keys/values are dropped so a stream consumer holds no cache
        result.outputs = {"token": token, "delta": self._delta(state)}
        return state

    @staticmethod
    def _delta(state: LoopState) -> str:
        """Text not streamed yet that can no longer change: held back while it may be the start of a stop
        string or ends in an incomplete character; all of it once the loop stops."""
        values = state.values
        text, sent = values["text"], values["streamed"]
        end = len(text)
        if values["stop_reason"] is None:
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
            held = max(
                (n for s in values["stop"] for n in range(1, len(s)) if text[:end].endswith(s[:n])), default=0
            )
            end = max(sent, end - held)
        values["streamed"] = end
        return text[sent:end]

    def _take(self, state: LoopState, token: int) -> None:
        """Fold one sampled token: EOS, then stop strings, then max_tokens."""
        inst, values = self.instance, state.values
        if token == inst.special["eos_token_id"]:
            values["stop_reason"] = "eos"
            return
        values["generated"].append(token)
        values["token"] = token
        text = inst.tokenizer.decode(values["generated"])
        hits = [i for s in values["stop"] if (i := text.find(s)) >= 0]
        if hits:
            values["text"], values["stop_reason"] = text[: min(hits)], "stop"
            return
        values["text"] = text
        if len(values["generated"]) >= values["max_tokens"]:
            values["stop_reason"] = "max_tokens"

    def finalize(self, state: LoopState) -> LoopResult:
        v = state.values
        context = v["seq"]["length"]
        outputs: dict[str, Any] = {
            "text": v["text"],
            "tokens": torch.tensor(v["generated"], dtype=torch.long),
        }
        if v["keep_contexts"]:  # the next stage owns these pages now
            outputs["contexts"], v["kept"] = v["kept"], []
        self.release(state)
        return LoopResult(
            outputs=outputs,
            metrics={
                "steps": state.step,
                "stop_reason": v["stop_reason"],
                "completion_tokens": len(v["generated"]),
                "prompt_tokens": context - state.step,
                "weights_versions": v["weights_versions"],
            },
        )


def sample(
    logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float, top_k: int
) -> int:
    """One token from ``logits`` ``[V]``: greedy at temperature 0, else top-k, then top-p, then a draw."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    logits = logits.cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(logits, descending=True)
        probs = torch.softmax(logits[order], dim=-1)
        drop = probs.cumsum(0) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


# ---- image denoise ----


def schedule(steps: int, shift: float) -> tuple[list[float], list[float]]:
    """BAGEL's flow times: ``steps`` points from 1 to 0, shifted; returns the times run and their Euler dts."""
    t = torch.linspace(1, 0, steps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1].tolist(), (t[:-1] - t[1:]).tolist()


def guide(
    v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, text_scale: float, img_scale: float,
    renorm: str, renorm_min: float,
) -> torch.Tensor:  # fmt: skip
    """BAGEL's guided velocity: text CFG, then image CFG, renormed to at most the conditional's norm
    (``global``: over the whole image; ``channel``: per token; ``text_channel``: the text CFG per token)."""
    if v_text is None:
        return v
    guided = v_text + text_scale * (v - v_text)
    if renorm == "text_channel":
        scale = torch.norm(v, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
        guided = guided * scale.clamp(min=renorm_min, max=1.0)
        return v_img + img_scale * (guided - v_img) if v_img is not None else guided
    if v_img is not None:
        guided = v_img + img_scale * (guided - v_img)
    if renorm == "global":
        scale = torch.norm(v) / (torch.norm(guided) + 1e-8)
    else:
        scale = torch.norm(v, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
    return guided * scale.clamp(min=renorm_min, max=1.0)


class ImageLoop(_Base):
    """Image denoise (task ``t2i``): prefill the prompt, then Euler steps over the latent tokens with
    text (and image) CFG, then the FLUX decode. The denoise reuses the contexts' caches, never writes them."""

    CONTEXTS = ("cond", "text_uncond", "img_uncond")

    def init(self, request: Any, instance: Any = None, ctx: Any = None) -> LoopState:
        try:
            return self._init(request)
        except BaseException:  # refused before its state held them: the pages handed over come back
            for context in request.carry.get("contexts", []):
                self.instance.kv_pool.release(KVSeq(**context["seq"]))
            raise

    def _init(self, request: Any) -> LoopState:
        inst = self.instance
        p = _check_request(inst, request, GuidedParams)
        versions = self._pins(request, inst)
        net = inst.component("net", versions.get("net"))
        down = 8 * net.latent_patch_size  # the FLUX VAE is x8; 2x2 latent patches
        edit = next((part.image for part in request.parts if part.kind == "image"), None)
        if isinstance(p, EditParams):
            if edit is None:
                raise ConfigError("edit needs the image to edit. Fix: send one image part", param="image")
            most = net.max_latent_size * down  # BAGEL's vae transform: 512..1024 px a side, multiples of 16
            pixels = resized(edit, most, min(512, most // 2), down)
            height, width = pixels.shape[:2]
        else:
            assert isinstance(p, ImageParams)
            height, width = p.height, p.width
        rows, cols = height // down, width // down
        if max(rows, cols) > net.max_latent_size:
            most = net.max_latent_size * down
            raise ConfigError(
                f"size {width}x{height} exceeds this model's latent table ({most} px a side). "
                f"Fix: use at most {most}x{most}",
                param="height",
            )
        gen = torch.Generator(device="cpu").manual_seed(p.seed)
        times, dts = schedule(p.num_inference_steps, p.timestep_shift)
        state = LoopState(
            request_id=request.request_id,
            loop_id=inst.card.programs[request.task].stages[0],
            total_steps=len(times),
            generator=gen,
        )
        state.values["weights_versions"] = versions
        prompt = text_ids(inst, p.prompt)
        _check_positions(net, len(prompt) + 1, f"a prompt of {len(prompt)} tokens")
        dim = net.latent_patch_size**2 * net.latent_channels
        draws = NoiseDraws(gen, p)
        noise = draws.randn(rows * cols, dim)
        grid = grid_ids(rows, cols, net.max_latent_size).to(inst.device)
        state.tensors.update(latents=noise.to(inst.device), grid=grid)
        # a context is a sequence of the instance's KV pool and its next RoPE position; contexts that
        # share a prefix share its pages (forks, copy-on-write), never copies
        contexts: dict[str, dict[str, Any]] = {
            name: {"seq": _plain(KVSeq()), "rope": 0} for name in self.CONTEXTS
        }
        # t2i: the text-unconditioned context is the empty one before the prompt; the image-unconditioned
        # context holds the prompt (no image), so it IS the conditional one: an alias, not a copy
        # pending prefills: (context written, context extended, segment), in order
        text = {"kind": "text", "ids": prompt}
        pending: list[tuple[str, str, dict[str, Any]]] = [("cond", "cond", text)]
        aliases = {"img_uncond": "cond"}
        if isinstance(p, EditParams):
            # edit: cond = [image (VAE latent, then ViT), instruction]; text-unconditioned = the image
            # alone; image-unconditioned = the instruction alone (BAGEL's interleave_inference)
            state.tensors["edit.pixels"] = pixels.permute(2, 0, 1)[None].to(inst.device)
            c = net.latent_channels
            state.tensors["edit.noise"] = draws.randn(1, c, 2 * rows, 2 * cols).to(inst.device)
            patches, vit_ids = vit_patches(inst, net, (pixels.numpy() + 1) / 2)
            state.tensors["image0.patches"], state.tensors["image0.ids"] = patches, vit_ids
            pending = [
                ("text_uncond", "text_uncond", {"kind": "vae"}),
                ("text_uncond", "text_uncond", {"kind": "image", "index": 0}),
                ("cond", "text_uncond", text),
                ("img_uncond", "img_uncond", text),
            ]
            aliases = {}
        thinking = request.carry.get("thinking")
        if thinking is not None:
            # think-t2i: the AR stage's contexts after its system prompt and after the prompt are the
            # text- and image-unconditioned ones; the conditional one is the latter plus the thinking
            system, with_prompt = request.carry["contexts"][-2:]  # forks the AR stage handed over
            _check_written_by(request, versions.get("net"))
            pending, aliases = [("cond", "cond", {"kind": "text", "ids": text_ids(inst, thinking)})], {}
            contexts["text_uncond"], contexts["img_uncond"] = system, with_prompt
            cond = inst.kv_pool.fork(KVSeq(**with_prompt["seq"]))  # after all that can fail (see init)
            contexts["cond"] = {"seq": _plain(cond), "rope": with_prompt["rope"]}
        state.values.update(
            ctx=contexts,
            pending=pending,
            aliases=aliases,
            thinking=thinking,
            times=times,
            dts=dts,
            grid_shape=[rows, cols],
            phase="prefill",
            guidance=dict(
                text_scale=p.cfg_text_scale,
                img_scale=p.cfg_img_scale,
                interval=list(p.cfg_interval),
                renorm=p.cfg_renorm_type,
                renorm_min=p.cfg_renorm_min,
            ),  # fmt: skip
            branches_run=[],
        )
        return state

    def _ctx(self, state: LoopState, name: str) -> dict[str, Any]:
        ctx = state.values["ctx"][state.values["aliases"].get(name, name)]
        return {"seq": ctx["seq"], "pool": self.instance.kv_pool, "rope": ctx["rope"]}

    def kv_need(self, state: LoopState) -> tuple[PagedKVPool, int]:
        """The pool and the most pages this request holds at once: its contexts' pages now (shared pages
        once: handed over by an earlier stage, or forks) plus those its pending prefills write, counting a
        context's partly filled last page as copied. The denoise reads the contexts and writes none."""
        pool, v = self.instance.kv_pool, state.values
        own = [c["seq"] for name, c in v["ctx"].items() if name not in v["aliases"]]
        held = len({page for seq in own for page in seq["pages"]})
        length = {name: c["seq"]["length"] for name, c in v["ctx"].items()}
        new = 0
        for name, source, segment in v["pending"]:
            start = length[source]
            length[name] = start + self._tokens(state, segment)
            new += pool.pages_for(length[name]) - start // pool.page_size
        return pool, held + new

    def release(self, state: LoopState) -> None:
        """Return every context's pages (on finish, and when the request is cancelled or fails)."""
        contexts, aliases = state.values.get("ctx") or {}, state.values.get("aliases", {})
        for name, ctx in contexts.items():
            if name not in aliases:
                self.instance.kv_pool.release(KVSeq(**ctx["seq"]))
        state.values["ctx"] = {}

    def _branches(self, state: LoopState, t: float) -> list[str]:
        g = state.values["guidance"]
        lo, hi = g["interval"]
        if not (lo < t <= hi) or g["text_scale"] <= 1.0:
            return ["cond"]  # outside the interval (or without text CFG) the conditional alone
        return ["cond", "text_uncond"] + (["img_uncond"] if g["img_scale"] > 1.0 else [])

    def next(self, state: LoopState) -> WorkPlan | Done:
        v = state.values
        if v["pending"]:
            _, source, segment = v["pending"][0]
            return self._segment_plan(self._ctx(state, source), segment, state)
        if v["phase"] == "denoise":
            return self._denoise_plan(state)
        if v["phase"] == "decode":
            return self._decode_plan(state)
        return Done()

    def _denoise_plan(self, state: LoopState) -> WorkPlan:
        inst, v = self.instance, state.values
        t = v["times"][state.step]
        branches = self._branches(state, t)
        contexts = [self._ctx(state, b) for b in branches]
        rows, n = len(branches), state.tensors["latents"].shape[0]
        dev = inst.device
        sp = inst.special
        pos = torch.tensor([[c["rope"]] * (n + 2) for c in contexts], device=dev)
        inputs = _plan_inputs(
            contexts,
            latents=state.tensors["latents"].to(inst.dtype)[None].expand(rows, -1, -1),
            t=torch.full((rows,), t, device=dev),
            ids=torch.tensor([[sp["start_of_image"], sp["end_of_image"]]] * rows, device=dev),
            grid=state.tensors["grid"][None].expand(rows, -1),
            pos=pos,
        )
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=partial(denoise_body, self._net(state), inst.exact),
            inputs=inputs,
            batch_key=self._key(state, "diffusion_denoise", (*v["grid_shape"], inputs["ctx_k"].shape[3])),
            batch_size=rows,
            label=f"denoise {state.step + 1}/{state.total_steps} ({'+'.join(branches)})",
        )

    def _decode_plan(self, state: LoopState) -> WorkPlan:
        inst = self.instance
        net = self._net(state)
        rows, cols = state.values["grid_shape"]
        p, c = net.latent_patch_size, net.latent_channels
        x = state.tensors["latents"].reshape(rows, cols, p, p, c)
        latents = torch.einsum("hwpqc->chpwq", x).reshape(1, c, rows * p, cols * p)
        vae = self._module(state, "vae")
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(decode_body, vae),
            inputs={"latents": latents},
            # the VAE's convolutions are not row-invariant: the exact instance decodes each image alone
            batch_key=None if inst.exact else self._key(state, "vae_decode", tuple(latents.shape[1:]), "vae"),
            label="vae decode",
        )

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        v, out = state.values, result.outputs
        if v["pending"]:
            name, source, segment = v["pending"][0]
            if segment["kind"] == "vae" and "edit.latent" not in state.tensors:  # the encode ran
                rows, cols = v["grid_shape"]
                net = self._net(state)
                p, c = net.latent_patch_size, net.latent_channels
                z = out["latent"][0].reshape(c, rows, p, cols, p)
                state.tensors["edit.latent"] = torch.einsum("chpwq->hwpqc", z).reshape(rows * cols, p * p * c)
                return state
            v["pending"].pop(0)
            pool, src = self.instance.kv_pool, v["ctx"][source]
            if name == source:  # extend the context itself
                base = KVSeq(**src["seq"])
            else:  # a new context over the source's pages (shared, not copied)
                pool.release(KVSeq(**v["ctx"][name]["seq"]))
                base = pool.fork(KVSeq(**src["seq"]))
            advance = len(segment["ids"]) if segment["kind"] == "text" else 1
            seq = pool.append(base, *written(out, segment))
            v["ctx"][name] = {"seq": _plain(seq), "rope": src["rope"] + advance}
            if not v["pending"]:
                v["phase"] = "denoise"
            return state
        if v["phase"] == "decode":
            state.tensors["frames"] = out["frames"]
            v["phase"] = "done"
            return state
        branches = self._branches(state, v["times"][state.step])
        rows = dict(zip(branches, out["velocity"].float(), strict=True))
        g = v["guidance"]
        velocity = guide(
            rows["cond"], rows.get("text_uncond"), rows.get("img_uncond"), g["text_scale"], g["img_scale"],
            g["renorm"], g["renorm_min"],
        )  # fmt: skip
        state.tensors["latents"] = state.tensors["latents"] - velocity * v["dts"][state.step]
        v["branches_run"].append(len(branches))
        state.step += 1
        if state.step == state.total_steps:
            v["phase"] = "decode"
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        self.release(state)
        outputs = {"frames": state.tensors["frames"], "latents": state.tensors["latents"]}
        if state.values["thinking"] is not None:
            outputs["text"] = state.values["thinking"]  # think-t2i: the plan the image was made from
        return LoopResult(
            outputs=outputs,
            metrics={
                "steps": state.step,
                "branches_run": state.values["branches_run"],
                "weights_versions": state.values["weights_versions"],
            },
        )
