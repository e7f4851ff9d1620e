"""Open a built deck in headless Chromium, as a lecturer's laptop would, and check it:
every slide renders (visible, non-empty, inside the slide area), every slide has speaker
notes, every formula is typeset by MathJax without errors, no script error, and no
request leaves the machine (only ``file:``, ``data:``, ``blob:`` and ``about:`` URLs).

    python slides/browser.py build/slides/01_collectives.slides.html

Chromium is Debian's (``apt-get install chromium``), driven by Playwright's Python
package through ``executable_path``; Playwright's own browser downloads are never used.
``find_chromium()`` returns None when there is none: callers say so and skip.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile

LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                 # a second fence: even a request the page hooks miss cannot resolve a host
                 "--host-resolver-rules=MAP * ~NOTFOUND"]


def find_chromium() -> str | None:
    """Path of a Chromium to drive: $MINIDIST_CHROMIUM, else chromium on PATH, else None."""
    for candidate in (os.environ.get("MINIDIST_CHROMIUM"), shutil.which("chromium"),
                      shutil.which("chromium-browser"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def unavailable() -> str | None:
    """Why the browser check cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright; it is in the [dev] extra)"
    if find_chromium() is None:
        return "no Chromium found (apt-get install chromium, or set MINIDIST_CHROMIUM)"
    return None


@dataclasses.dataclass
class DeckReport:
    path: str
    slides: int = 0
    formulas: int = 0
    problems: list = dataclasses.field(default_factory=list)
    external_requests: list = dataclasses.field(default_factory=list)
    requests: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.external_requests

    def summary(self) -> str:
        head = (f"{os.path.basename(self.path)}: {self.slides} slides, {self.formulas} formulas, "
                f"{self.requests} requests, {len(self.external_requests)} leaving the machine")
        if self.ok:
            return head + ": ok"
        return head + "\n" + "\n".join("  - " + p for p in self.problems + 
                                       [f"request to {u}" for u in self.external_requests])


# Runs in the page once reveal.js and MathJax are ready: visits every slide (h, v), the
# way a presenter steps through, and measures what is shown.
_VISIT_ALL = """
async () => {
  Reveal.configure({transition: 'none', backgroundTransition: 'none'});   // measure slides at rest
  const out = [];
  const box = document.querySelector('.reveal .slides').getBoundingClientRect();
  for (const slide of Reveal.getSlides()) {
    const idx = Reveal.getIndices(slide);
    Reveal.slide(idx.h, idx.v, Number.MAX_SAFE_INTEGER);   // all fragments shown
    await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
    const r = slide.getBoundingClientRect();
    const style = getComputedStyle(slide);
    const notes = (Reveal.getSlideNotes(slide) || '').replace(/<[^>]*>/g, '').trim();
    const title = (slide.querySelector('h1, h2, h3') || {}).textContent || '';
    out.push({h: idx.h, v: idx.v, title: title.replace('¶', '').trim(),
              current: Reveal.getCurrentSlide() === slide,
              visible: style.display !== 'none' && style.visibility !== 'hidden' && r.width > 0 && r.height > 0,
              text: slide.innerText.trim().length, images: slide.querySelectorAll('img, svg').length,
              broken: Array.from(slide.querySelectorAll('img')).filter(i => !(i.complete && i.naturalWidth > 0)).length,
              notes: notes.length,
              inside: r.left >= box.left - 2 && r.right <= box.right + 2,
              fits: slide.scrollHeight <= Reveal.getConfig().height + 2});
  }
  return out;
}
"""

_MATH = """
() => ({
  typeset: document.querySelectorAll('mjx-container svg').length,
  containers: document.querySelectorAll('mjx-container').length,
  errors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
  raw: Array.from(document.querySelectorAll('.reveal .slides section'))
        .filter(s => /\\$\\$|\\\\frac|\\\\text\\{/.test(s.innerText)).length
})
"""


def check_deck(path: str, timeout_s: float = 20, screenshot: str | None = None) -> DeckReport:
    """Load ``path`` in headless Chromium with a fresh profile and check it (see the module doc)."""
    from playwright.sync_api import Error as PlaywrightError, sync_playwright

    report = DeckReport(path=path)
    errors = []

    def on_route(route):
        url = route.request.url
        report.requests += 1
        if url.startswith(LOCAL_SCHEMES):
            route.continue_()
        else:
            report.external_requests.append(url)
            route.abort()

    with tempfile.TemporaryDirectory(prefix="minidist-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=find_chromium(), args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 800}, service_workers="block")
        try:
            context.route("**/*", on_route)
            page = context.new_page()
            page.on("pageerror", lambda exc: errors.append(f"script error: {exc}"))
            page.on("console", lambda msg: msg.type == "error" and errors.append(f"console error: {msg.text}"))
            page.on("requestfailed", lambda req: req.url.startswith(LOCAL_SCHEMES)
                    and errors.append(f"local request failed: {req.url[:120]}"))
            page.set_default_timeout(timeout_s * 1000)
            page.goto("file://" + os.path.abspath(path))
            try:
                page.wait_for_function("() => window.Reveal && Reveal.isReady && Reveal.isReady()")
                page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
                page.evaluate("() => MathJax.startup.promise")
            except PlaywrightError as err:
                report.problems += errors + [f"reveal.js or MathJax did not start: {str(err).splitlines()[0]}"]
                return report
            slides = page.evaluate(_VISIT_ALL)
            math = page.evaluate(_MATH)
            if screenshot:
                page.evaluate("() => Reveal.slide(0, 0)")
                page.screenshot(path=screenshot)
        finally:
            context.close()

    report.slides, report.formulas = len(slides), math["typeset"]
    report.problems += errors
    if not slides:
        report.problems.append("reveal.js found no slides")
    for s in slides:
        where = f"slide {s['h']}.{s['v']} ({s['title'][:40] or 'untitled'})"
        if not (s["current"] and s["visible"]):
            report.problems.append(f"{where} is not shown when visited")
        if s["text"] == 0 and s["images"] == 0:
            report.problems.append(f"{where} is empty")
        if s["broken"]:
            report.problems.append(f"{where}: {s['broken']} images do not load")
        if s["notes"] == 0:
            report.problems.append(f"{where} has no speaker notes")
        if not s["inside"]:
            report.problems.append(f"{where} is wider than the slide area")
        if not s["fits"]:
            report.problems.append(f"{where} is taller than the slide area (the lecturer must scroll)")
    if math["errors"]:
        report.problems.append(f"{math['errors']} formulas failed to typeset")
    if math["typeset"] < math["containers"]:
        report.problems.append(f"only {math['typeset']} of {math['containers']} formulas rendered")
    if math["raw"]:
        report.problems.append(f"{math['raw']} slides show raw TeX")
    return report


if __name__ == "__main__":
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        sys.exit(0)
    reports = [check_deck(p) for p in sys.argv[1:]]
    for rep in reports:
        print(rep.summary())
    sys.exit(0 if all(r.ok for r in reports) else 1)
