"""``GET /v1/videos/{id}/stream``: a running video's chunks as server-sent events, as the model makes them.

A streaming loop (a causal card: chunk by chunk) emits each finished chunk's frames; the server keeps
them, as PNGs, while the job runs, and every subscriber gets all chunks from the first, then the job's
final state. Server-sent events rather than a fragmented mp4: each event carries the chunk's index and
first frame beside lossless frames, any HTTP client reads them line by line (through proxies, with
reconnects by chunk index), and the finished mp4 stays at ``/content``.

Events: ``event: chunk`` with ``{"object": "video.chunk", "video_id", "chunk", "first_frame",
"frames": [base64 PNG, ...]}``, then ``event: video`` with the job (as ``GET /v1/videos/{id}``),
then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from fv_core.serving.media import encode_png
from fv_core.serving.schemas import Video


@dataclass
class VideoChunks:
    """The chunks a running job has streamed so far (base64 PNG frames), and whether it ended."""

    chunks: list[list[str]] = field(default_factory=list)
    done: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, frames: np.ndarray) -> None:
        """A chunk's frames ``[F, H, W, 3]`` in 0..1 (encoded off the event loop)."""
        pngs = await asyncio.to_thread(lambda: [base64.b64encode(encode_png(f)).decode() for f in frames])
        async with self.changed:
            self.chunks.append(pngs)
            self.changed.notify_all()

    async def end(self) -> None:
        async with self.changed:
            self.done = True
            self.changed.notify_all()

    def _past(self, index: int) -> bool:
        """The job ended, or streamed chunk ``index``."""
        return self.done or len(self.chunks) > index

    async def follow(self) -> AsyncIterator[tuple[int, int, list[str]]]:
        """(chunk index, its first frame's index, its frames) from the first chunk until the job ends."""
        index, first = 0, 0
        while True:
            async with self.changed:
                await self.changed.wait_for(partial(self._past, index))
                ready, done = self.chunks[index:], self.done
            for frames in ready:
                yield index, first, frames
                index, first = index + 1, first + len(frames)
            if done and index == len(self.chunks):
                return


async def events(video_id: str, chunks: VideoChunks | None, final: Callable[[], Video]) -> AsyncIterator[str]:
    """The SSE body: every chunk (none when the job is not running here), then ``final()``'s job."""
    if chunks is not None:
        async for index, first, frames in chunks.follow():
            body = {"object": "video.chunk", "video_id": video_id, "chunk": index, "first_frame": first}
            yield f"event: chunk\ndata: {json.dumps({**body, 'frames': frames})}\n\n"
    yield f"event: video\ndata: {final().model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"
