"""The permission bits of the files hf_cephalo writes: those of a plain ``open(path, "w")``.

[Note: file modes] A file created by ``open()``, ``torch.save`` or ``json.dump`` gets
``0o666 & ~umask`` (0o644 under the usual umask 022). Two writers we use do not:
``tempfile.mkstemp`` always creates 0o600, and safetensors >= 0.8 writes ``save_file`` through
a temporary file of mode 0o600 that it renames into place (safetensors issue #782). A
checkpoint or export whose weight files are 0o600 beside 0o644 configs cannot be read by
another user or service account (a shared cluster, a container running as another user).
Every writer that creates a file through a temporary file, or through safetensors, calls
``apply_default_mode`` on the result (before renaming it into place), so what we write matches
``open()``: the umask decides, as for the configs in the same directory.
"""

from __future__ import annotations

import os

__all__ = ["current_umask", "default_file_mode", "apply_default_mode"]


def current_umask() -> int:
    """The process umask, e.g. ``0o022``.

    Read from ``/proc/self/status`` where the kernel reports it (Linux >= 4.7): reading it
    changes nothing. Elsewhere ``os.umask(0)`` then restores the old value at once; between
    the two calls a file another thread creates would get mode 0o666, so that path is the
    fallback only.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """``0o666 & ~umask``: the permission bits ``open(path, "w")`` gives a new file."""
    return 0o666 & ~current_umask()


def apply_default_mode(path: str | os.PathLike) -> None:
    """Set ``path``'s permission bits to ``default_file_mode()`` ([Note: file modes]).

    Raises:
        OSError: ``path`` does not exist or its mode cannot be changed.
    """
    os.chmod(path, default_file_mode())
