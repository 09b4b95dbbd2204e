"""Artifacts save their file plus the provenance JSON; video with audio muxes into one mp4."""

from __future__ import annotations

import json
import subprocess
import wave

import imageio.v2 as imageio
import imageio_ffmpeg
import numpy as np
import pytest

from fv_core.artifacts import AudioArtifact, ImageArtifact, TextArtifact, VideoArtifact
from fv_core.errors import ConfigError, FvError

PROV = {"card": "toy", "seed": 7}
RATE = 16000


def frames(n: int = 5) -> np.ndarray:
    return np.random.default_rng(0).random((n, 32, 32, 3), dtype=np.float32)


def tone(seconds: float = 0.5, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    wave_ = 0.5 * np.sin(2 * np.pi * 440 * t).astype(np.float32)
    return wave_ if channels == 1 else np.stack([wave_, -wave_])


def streams(path) -> str:
    """ffmpeg's description of the file's streams (it prints them to stderr)."""
    result = subprocess.run(
        [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)], capture_output=True, text=True
    )
    return result.stderr


def provenance_of(path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def test_video_saves_mp4_and_provenance(tmp_path):
    out = VideoArtifact(frames(), fps=8, provenance=PROV).save(tmp_path / "v.mp4")
    assert out == tmp_path / "v.mp4" and provenance_of(out) == PROV
    info = streams(out)
    assert "Video: h264" in info and "Audio:" not in info
    assert imageio_ffmpeg.count_frames_and_secs(str(out))[0] == 5


def test_video_with_audio_muxes_one_mp4(tmp_path):
    audio = AudioArtifact(tone(seconds=5 / 8, channels=2), RATE)
    out = VideoArtifact(frames(), fps=8, provenance=PROV, audio=audio).save(tmp_path / "av.mp4")
    info = streams(out)
    assert "Video: h264" in info and "Audio: aac" in info
    assert imageio_ffmpeg.count_frames_and_secs(str(out))[0] == 5
    assert provenance_of(out) == PROV
    assert sorted(p.name for p in tmp_path.iterdir()) == ["av.json", "av.mp4"]  # no temp files left


def test_single_frame_png_rule_kept(tmp_path):
    out = VideoArtifact(frames(1), provenance=PROV).save(tmp_path / "f.png")
    assert imageio.imread(out).shape == (32, 32, 3) and provenance_of(out) == PROV
    with pytest.raises(ConfigError, match="holds one frame.*Fix: write .mp4"):
        VideoArtifact(frames(2)).save(tmp_path / "two.png")


def test_video_with_audio_rejects_png(tmp_path):
    video = VideoArtifact(frames(1), audio=AudioArtifact(tone(), RATE))
    with pytest.raises(ConfigError, match=r"'\.png'.*Fix: name the file e\.g\. 'x\.mp4'"):
        video.save(tmp_path / "x.png")


@pytest.mark.parametrize("exe", ["missing", "failing"])
def test_failed_mux_raises_and_leaves_no_temp_files(tmp_path, monkeypatch, exe):
    fake = tmp_path / "bin" / "ffmpeg"
    if exe == "failing":  # runs, prints an error, exits 1
        fake.parent.mkdir()
        fake.write_text("#!/bin/sh\necho 'Conversion failed: disk on fire' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(fake))
    out_dir = tmp_path / "out"
    video = VideoArtifact(frames(), audio=AudioArtifact(tone(), RATE))
    match = "ffmpeg not found.*Fix:" if exe == "missing" else "exit 1.*disk on fire.*Fix:"
    with pytest.raises(FvError, match=match):
        video.save(out_dir / "av.mp4")
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("channels", [1, 2])
def test_audio_wav_round_trips(tmp_path, channels):
    samples = tone(channels=channels)
    audio = AudioArtifact(samples, RATE, provenance=PROV)
    assert audio.seconds == pytest.approx(0.5)
    out = audio.save(tmp_path / "a.wav")
    assert provenance_of(out) == PROV
    with wave.open(str(out)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (RATE, channels, 2)
        assert f.getnframes() == samples.shape[-1]
        pcm = np.frombuffer(f.readframes(f.getnframes()), "<i2").reshape(-1, channels).T
    np.testing.assert_allclose(pcm / 32767, np.atleast_2d(samples), atol=1 / 32767)


def test_audio_clips_out_of_range(tmp_path):
    out = AudioArtifact(np.array([-3.0, 0.0, 3.0], np.float32), RATE).save(tmp_path / "a.wav")
    with wave.open(str(out)) as f:
        assert np.frombuffer(f.readframes(3), "<i2").tolist() == [-32767, 0, 32767]


@pytest.mark.parametrize("name", ["x.png", "x.jpg", "x.webp"])
def test_image_saves(tmp_path, name):
    image = frames(1)[0]
    out = ImageArtifact(image, provenance=PROV).save(tmp_path / name)
    assert provenance_of(out) == PROV
    back = imageio.imread(out)
    assert back.shape[:2] == (32, 32)
    if name == "x.png":  # lossless
        np.testing.assert_array_equal(back, (image * 255).round().astype(np.uint8))


def test_text_saves_utf8(tmp_path):
    out = TextArtifact("ein Fuß, 一只猫", provenance=PROV).save(tmp_path / "t.txt")
    assert out.read_bytes().decode("utf-8") == "ein Fuß, 一只猫" and provenance_of(out) == PROV


@pytest.mark.parametrize(
    ("artifact", "name", "fix"),
    [
        (lambda: ImageArtifact(np.zeros((4, 4, 3), np.float32)), "x.gif", "'x.png'"),
        (lambda: AudioArtifact(tone(), RATE), "x.mp3", "'x.wav'"),
        (lambda: TextArtifact("hi"), "x.md", "'x.txt'"),
        (lambda: VideoArtifact(frames(), audio=AudioArtifact(tone(), RATE)), "x.webm", "'x.mp4'"),
    ],
)
def test_bad_suffix_is_config_error(tmp_path, artifact, name, fix):
    with pytest.raises(ConfigError, match=f"{name[1:]!r}.*Fix: name the file e.g. {fix}") as e:
        artifact().save(tmp_path / name)
    assert name in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: VideoArtifact(np.zeros((32, 32, 3), np.float32)),
            r"\(32, 32, 3\).*\[frames, height, width, 3\].*Fix",
        ),
        (
            lambda: VideoArtifact(np.zeros((2, 3, 8, 8), np.float32)),
            r"\(2, 3, 8, 8\).*Fix: move channels last",
        ),
        (lambda: VideoArtifact(frames(), fps=0), "fps=0.*Fix"),
        (
            lambda: ImageArtifact(np.zeros((1, 8, 8, 3), np.float32)),
            r"\(1, 8, 8, 3\).*\[height, width, 3\].*Fix",
        ),
        (lambda: AudioArtifact(np.zeros((2, 2, 10), np.float32), RATE), r"\(2, 2, 10\).*Fix"),
        (lambda: AudioArtifact(np.zeros((1000, 2), np.float32), RATE), "1000 channels.*Fix: .*samples.T"),
        (lambda: AudioArtifact(tone(), 0), "sample_rate=0.*Fix"),
    ],
)
def test_bad_inputs_are_config_errors(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
