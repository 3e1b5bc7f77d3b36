"""The one error type a user sees: the CLI prints its message as one line and exits (2 by default)."""

import contextlib


class GpuwiseError(Exception):
    """Bad input or an impossible request. The message is the whole story for the user."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def closest(word: str, choices, n: int = 3) -> str:
    """'closest: a, b, c' for an unknown name, or '' when nothing is near."""
    import difflib

    choices = list(choices)
    near = difflib.get_close_matches(word.lower(), choices, n=n, cutoff=0.5)
    if not near:
        # Substring hits catch "h100" -> h100-sxm/h100-pcie, which difflib ranks low.
        near = [c for c in choices if word.lower() in c][:n]
    return f" (closest: {', '.join(near)})" if near else ""


def first_line(e: BaseException) -> str:
    """'Type: the first line of its message', for an error from a library passed on as one line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


@contextlib.contextmanager
def loading_model(run_dir, flag: str = ""):
    """A run's files are untrusted input (truncated, hand-edited, planted): whatever they make safetensors,
    json, transformers or torch raise while loading becomes one line."""
    try:
        yield
    except GpuwiseError:
        raise
    except Exception as e:  # noqa: BLE001 - each loader raises its own types
        where = f"{flag} {run_dir}" if flag else str(run_dir)
        raise GpuwiseError(f"{where}: cannot load the trained model ({first_line(e)})") from None
