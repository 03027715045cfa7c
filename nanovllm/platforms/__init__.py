"""One class per device (platforms/cpu.py, platforms/cuda.py) behind the Platform interface
(interface.py). Config calls get_platform once; everything else asks config.platform."""
from nanovllm.platforms.cpu import CpuPlatform
from nanovllm.platforms.cuda import CudaPlatform
from nanovllm.platforms.interface import Platform

_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}
DEVICES = ("auto", *_PLATFORMS)


def get_platform(device: str) -> Platform:
    """The platform of a Config.device value; "auto" is CUDA when this process sees a GPU, else CPU."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    platform = _PLATFORMS[device]
    if not platform.is_available():
        raise ValueError(f"device={device!r} was asked for but torch sees no {device.upper()} device")
    return platform()


__all__ = ["DEVICES", "CpuPlatform", "CudaPlatform", "Platform", "get_platform"]
