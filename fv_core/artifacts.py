"""Artifacts: typed outputs (video, image, audio, text) with their provenance.

Every artifact's ``save(path)`` writes the file and, next to it,
``path.with_suffix('.json')`` holding the provenance (card, recipe, seed,
weights hash, kernels, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fv_core.errors import ConfigError, FvError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
AUDIO_SUFFIXES = (".wav",)
AV_SUFFIXES = (".mp4", ".mov", ".mkv")  # containers that hold H.264 video with AAC audio
# artifact kind -> the suffixes it saves as (a one-frame video may also be a .png)
SUFFIXES = {
    "video": (*AV_SUFFIXES, ".png"),
    "image": IMAGE_SUFFIXES,
    "audio": AUDIO_SUFFIXES,
    "text": (".txt",),
}


def _prepare(path: str | Path, kind: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """Check ``path``'s suffix against ``suffixes`` (None: any) and create its folder."""
    path = Path(path)
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(
            f"{str(path)!r} has suffix {path.suffix!r}; a {kind} is saved as one of {', '.join(suffixes)}. "
            f"Fix: name the file e.g. {path.with_suffix(suffixes[0]).name!r}."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_provenance(path: Path, provenance: dict[str, Any]) -> None:
    """Write the provenance as ``path.with_suffix('.json')``."""
    path.with_suffix(".json").write_text(json.dumps(provenance, indent=2, default=str))


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Pixels in 0..1 as 8-bit values (clipped, rounded)."""
    return (np.clip(pixels, 0, 1) * 255).round().astype(np.uint8)


@dataclass(slots=True)
class AudioArtifact:
    """Samples ``[samples]`` or ``[channels, samples]`` float32 in -1..1 at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.samples.ndim not in (1, 2):
            raise ConfigError(
                f"audio samples have shape {tuple(self.samples.shape)}; they must be [samples] or "
                "[channels, samples]. Fix: squeeze or reshape the array."
            )
        if self.samples.ndim == 2 and self.samples.shape[0] > 8:
            raise ConfigError(
                f"audio samples have shape {tuple(self.samples.shape)}, i.e. {self.samples.shape[0]} channels; "
                "at most 8 are allowed, channels first. Fix: if this is [samples, channels], pass samples.T."
            )
        if self.sample_rate <= 0:
            raise ConfigError(
                f"sample_rate={self.sample_rate!r}; it must be a positive number of Hz. Fix: pass e.g. 16000."
            )

    @property
    def seconds(self) -> float:
        """Duration in seconds."""
        return self.samples.shape[-1] / self.sample_rate

    def save(self, path: str | Path) -> Path:
        """Write 16-bit PCM ``.wav`` and the provenance as JSON next to it."""
        path = _prepare(path, "audio clip", AUDIO_SUFFIXES)
        self._write_wav(path)
        write_provenance(path, self.provenance)
        return path

    def _write_wav(self, path: Path) -> None:
        channels = np.atleast_2d(self.samples)  # [channels, samples]
        pcm = (np.clip(channels, -1, 1) * 32767).round().astype("<i2")
        with wave.open(str(path), "wb") as out:
            out.setnchannels(pcm.shape[0])
            out.setsampwidth(2)
            out.setframerate(self.sample_rate)
            out.writeframes(pcm.T.tobytes())  # interleaved: one sample per channel per frame


@dataclass(slots=True)
class VideoArtifact:
    """Frames ``[F, H, W, 3]`` float32 in 0..1, optional sound, and how they were made."""

    frames: np.ndarray  # [frames, height, width, 3], 0..1
    fps: int = 16  # playback rate
    provenance: dict[str, Any] = field(default_factory=dict)  # card, recipe, seed, weights hash, kernels, ...
    audio: AudioArtifact | None = None  # muxed into the same file when saved as a video
    stages: dict[str, Any] | None = None  # a workflow's stage artifacts by stage name (``keep: all``)

    def __post_init__(self) -> None:
        if self.frames.ndim != 4 or self.frames.shape[-1] != 3:
            raise ConfigError(
                f"video frames have shape {tuple(self.frames.shape)}; they must be [frames, height, width, 3]. "
                "Fix: move channels last (e.g. permute(0, 2, 3, 1)) and keep RGB only."
            )
        if self.fps <= 0:
            raise ConfigError(f"fps={self.fps!r}; it must be positive. Fix: pass e.g. fps=16.")

    def save(self, path: str | Path) -> Path:
        """Write an H.264 mp4 (with AAC sound when ``audio`` is set), or a PNG for a single
        frame, and the provenance as JSON next to it."""
        import imageio.v2 as imageio

        if self.audio is None:
            path = _prepare(path, "video", SUFFIXES["video"])
        else:
            path = _prepare(path, "video with sound", AV_SUFFIXES)
        pixels = to_uint8(self.frames)
        if path.suffix.lower() == ".png":
            if len(pixels) != 1:
                raise ConfigError(
                    f"{path} is a .png, which holds one frame; this video has {len(pixels)}. "
                    "Fix: write .mp4, or generate 1 frame."
                )
            imageio.imwrite(path, pixels[0])
        elif self.audio is None:
            self._write_video(path, pixels)
        else:
            self._write_with_audio(path, pixels, self.audio)
        write_provenance(path, self.provenance)
        return path

    def _write_video(self, path: Path, pixels: np.ndarray) -> None:
        import imageio.v2 as imageio

        imageio.mimwrite(path, list(pixels), fps=self.fps, codec="libx264", quality=8, macro_block_size=1)

    def _write_with_audio(self, path: Path, pixels: np.ndarray, audio: AudioArtifact) -> None:
        """Write video and sound to temp files, mux them with ffmpeg (the sound track cut or padded with
        silence to the video's length: every frame is kept), then rename into place."""
        import imageio_ffmpeg

        # A hidden temp folder next to ``path`` (same filesystem, so the rename is atomic);
        # it is removed with whatever is left in it, on success and on error alike.
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}.") as temp:
            video, sound, muxed = (
                Path(temp, "video" + path.suffix),
                Path(temp, "sound.wav"),
                Path(temp, path.name),
            )
            self._write_video(video, pixels)
            audio._write_wav(sound)
            ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()  # looked up per call: IMAGEIO_FFMPEG_EXE may override
            command = [ffmpeg, "-y", "-loglevel", "error", "-i", str(video), "-i", str(sound)]
            command += [
                "-map",
                "0:v:0",
                "-map",
                "1:a:0",
                "-c:v",
                "copy",
                "-c:a",
                "aac",
                "-af",
                "apad",  # sound shorter than the frames is padded with silence ...
                "-shortest",  # ... and both tracks end with the last frame
                str(muxed),
            ]
            try:
                subprocess.run(command, check=True, capture_output=True, text=True)
            except FileNotFoundError as e:
                raise FvError(
                    f"ffmpeg not found at {ffmpeg!r}; muxing {path.name} needs it. "
                    "Fix: reinstall imageio-ffmpeg, or point IMAGEIO_FFMPEG_EXE at an ffmpeg binary."
                ) from e
            except subprocess.CalledProcessError as e:
                tail = (e.stderr or "").strip()[-2000:]
                raise FvError(
                    f"ffmpeg failed (exit {e.returncode}) muxing video and sound into {path.name}: {tail}. "
                    "Fix: check the file name's container supports H.264 + AAC, and the disk has room."
                ) from e
            os.replace(muxed, path)  # atomic: readers never see a half-written file


class VideoStream:
    """An mp4 written as frames come (``write`` each batch, then ``close``): fragmented, without
    lookahead, so a player can read the file while it grows. What ``fv generate --stream`` writes."""

    def __init__(self, path: str | Path, fps: int) -> None:
        import imageio.v2 as imageio

        self.path = _prepare(path, "video stream", (".mp4",))
        self.frames = 0
        self._writer = imageio.get_writer(
            self.path, fps=fps, codec="libx264", quality=8, macro_block_size=1,
            output_params=["-tune", "zerolatency", "-movflags", "frag_keyframe+empty_moov+default_base_moof",
                           "-frag_duration", "250000", "-flush_packets", "1"],
        )  # fmt: skip

    def write(self, frames: np.ndarray) -> None:
        """Append frames ``[F, H, W, 3]`` in 0..1."""
        for frame in to_uint8(frames):
            self._writer.append_data(frame)
        self.frames += len(frames)

    def close(self) -> None:
        self._writer.close()


@dataclass(slots=True)
class ImageArtifact:
    """One image ``[H, W, 3]`` float32 in 0..1, and how it was made."""

    image: np.ndarray
    provenance: dict[str, Any] = field(default_factory=dict)
    text: TextArtifact | None = None  # text made with it (think-t2i's thinking), saved beside it as .txt
    stages: dict[str, Any] | None = None  # a workflow's stage artifacts by stage name (``keep: all``)

    def __post_init__(self) -> None:
        if self.image.ndim != 3 or self.image.shape[-1] != 3:
            raise ConfigError(
                f"image has shape {tuple(self.image.shape)}; it must be [height, width, 3]. "
                "Fix: move channels last and keep RGB only (for a video frame, take frames[i])."
            )

    def save(self, path: str | Path) -> Path:
        """Write a ``.png``, ``.jpg`` or ``.webp``, the provenance as JSON next to it, and the companion
        ``text`` (when set) as ``.txt`` next to it."""
        import imageio.v2 as imageio

        path = _prepare(path, "image", IMAGE_SUFFIXES)
        imageio.imwrite(path, to_uint8(self.image))
        write_provenance(path, self.provenance)
        if self.text is not None:
            path.with_suffix(".txt").write_text(self.text.text, encoding="utf-8")
        return path


@dataclass(slots=True)
class TextArtifact:
    """Generated text (a caption, an answer), and how it was made."""

    text: str
    provenance: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write UTF-8 text and the provenance as JSON next to it."""
        path = _prepare(path, "text", (".txt",))
        path.write_text(self.text, encoding="utf-8")
        write_provenance(path, self.provenance)
        return path
