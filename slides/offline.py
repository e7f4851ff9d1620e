"""Everything a deck needs to present, inlined: reveal.js, its speaker-notes plugin, its
theme and fonts, and MathJax. A built deck is one HTML file that opens from disk in a
lecture hall without network and sends no request anywhere.

The assets come from the npm packages ``reveal.js`` and ``mathjax`` (pinned below),
fetched once with ``npm pack`` into ``build/vendor/`` and read from there afterwards.
MathJax is version 3 with SVG output: its fonts are paths inside the script (nothing
more to load), and it typesets slides that reveal.js keeps hidden.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "vendor")
PACKAGES = {"reveal.js": "5.2.1", "mathjax": "3.2.2"}
THEME = "white"


class VendorError(RuntimeError):
    """The assets could not be fetched (no npm, no registry) and are not cached."""


def package_dir(name: str, cache: str = CACHE) -> str:
    """The unpacked npm package ``name`` at its pinned version, fetched on first use.

    Several builds may start at once on an empty cache (the deck tests build three at a time;
    a lecturer may run ``slides/build.py`` on several decks in parallel):
    each fetches into a folder of its own and renames the result into place, which is
    atomic; whoever comes second finds the package there and drops its copy."""
    version = PACKAGES[name]
    target = os.path.join(cache, f"{name}-{version}")
    if os.path.isfile(os.path.join(target, "package.json")):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise VendorError(f"building decks needs {name}@{version} once, from npm; npm is not installed "
                          f"(or unpack the package into {target})")
    os.makedirs(cache, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{name}-{version}.", dir=cache)
    try:
        try:
            out = subprocess.run([npm, "pack", f"{name}@{version}", "--silent", "--pack-destination", work],
                                 capture_output=True, text=True, timeout=300, check=True)
        except (subprocess.SubprocessError, OSError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            raise VendorError(f"npm pack {name}@{version} failed: {detail.strip()[-500:]}") from err
        with tarfile.open(os.path.join(work, out.stdout.strip().splitlines()[-1])) as tar:
            tar.extractall(os.path.join(work, "unpacked"), filter="data")
        try:   # npm tarballs hold one folder, package/
            os.replace(os.path.join(work, "unpacked", "package"), target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "package.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _data_uri(path: str, mime: str) -> str:
    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


def _theme_css(reveal: str) -> str:
    """The theme with its ``@import`` of the font sheet replaced by the fonts themselves
    (woff only, as data URIs: every browser that runs reveal.js 5 reads woff)."""
    theme_dir = os.path.join(reveal, "dist", "theme")
    css = _read(os.path.join(theme_dir, f"{THEME}.css"))

    def inline_fonts(match):
        sheet_path = os.path.normpath(os.path.join(theme_dir, match.group(1)))
        sheet_dir = os.path.dirname(sheet_path)
        faces = []
        for face in re.findall(r"@font-face\s*{[^}]*}", _read(sheet_path)):
            woff = re.search(r"url\('?([^')]+\.woff)'?\)", face).group(1)
            uri = _data_uri(os.path.join(sheet_dir, woff), "font/woff")
            face = re.sub(r"src:[^;]*;\s*src:[^;]*;", f"src: url({uri}) format('woff');", face)
            faces.append(face)
        return "\n".join(faces)

    css = re.sub(r"@import url\(([^)]+\.css)\);", inline_fonts, css)
    if re.search(r"url\((?!data:)", css):
        raise VendorError(f"theme {THEME} still refers to a file after inlining")
    return css


def assets(cache: str = CACHE) -> dict:
    """The texts the deck template inlines: ``reveal_css``, ``theme_css``, ``reveal_js``,
    ``notes_js``, ``mathjax_js``."""
    reveal, mathjax = package_dir("reveal.js", cache), package_dir("mathjax", cache)
    return {
        "reveal_css": _read(os.path.join(reveal, "dist", "reveal.css")),
        "theme_css": _theme_css(reveal),
        "reveal_js": script_safe(_read(os.path.join(reveal, "dist", "reveal.js"))),
        "notes_js": script_safe(_read(os.path.join(reveal, "plugin", "notes", "notes.js"))),
        "mathjax_js": script_safe(_read(os.path.join(mathjax, "es5", "tex-svg.js"))),
        "versions": dict(PACKAGES),
    }


def script_safe(text: str) -> str:
    """JavaScript that can sit inside a <script> element: no literal ``</script`` or
    ``<!--`` (both only occur inside strings and regular expressions, where ``\\/`` and
    ``\\!`` mean the same)."""
    return re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE).replace("<!--", "<\\!--")
