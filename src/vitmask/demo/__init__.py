"""`vitmask demo`: a local web page to play with a model, computed by the library code of the verbs.

- models.py: what the page serves: the masked-patch model and the classifier, opened by the loaders
  every verb uses, and the test images to pick from;
- app.py: the Starlette app: the page and its JSON endpoints, each request answered from what it
  carries alone (the page holds the state), one model computation at a time;
- serve.py: listening on --host and --port, uvicorn, and stopping by SIGINT or SIGTERM;
- static/: the page itself, plain HTML, JavaScript and a canvas: no build step, nothing fetched
  from anywhere but the demo's own server.

Only this package imports starlette and uvicorn (the demo extra); `require_demo_extra` says how to
install them when they are missing. Importing this module imports neither, nor torch.
"""

import importlib.util

from vitmask.errors import UserError

EXTRA_PACKAGES = ("starlette", "uvicorn")


def missing_demo_packages() -> list[str]:
    """The packages of the demo extra that cannot be imported here."""
    missing = []
    for name in EXTRA_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
            found = False
        if not found:
            missing.append(name)
    return missing


def require_demo_extra() -> None:
    """One line naming the missing packages, and the install command, when the demo extra is not installed."""
    missing = missing_demo_packages()
    if missing:
        raise UserError(
            f"vitmask demo needs the demo extra, and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not installed; run: pip install -e '.[demo]' in the checkout (make train and make test install it)"
        )
