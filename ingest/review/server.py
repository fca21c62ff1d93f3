"""``uflash review``: the review page of a run, served from this machine so that a person can change the result: edit a
page's text block by block and save it (a reading of the page marked as a person's: ingest.review.corrections), undo
it back to the model's reading, mark a page checked, and queue a lossless re-run of the pages picked
(ingest.review.rerun_queue). Every save and undo writes the document's outputs again (ingest.worker.finish).

Starlette on uvicorn: a small, well-kept ASGI framework and server (both from the encode project) with a test client
and no template or ORM layer to learn; the page itself is the report's own HTML (ingest.review.page).

Who may use it (``Guard``, on every request):
- it listens on 127.0.0.1 unless told otherwise (``--host``);
- the Host header must name the address it serves (a page of another site that a browser resolved to this machine,
  DNS rebinding, is refused);
- the URL it prints carries a random token (``secrets.token_urlsafe``): the page is served only with it (``?token=``),
  and every API call must carry it in the ``X-Uflash-Token`` header;
- a request that changes anything (POST) must come from the page's own origin (``Origin``) with a JSON body;
- no request names a file: pages, documents and runs are named by their ids in the ledger (integers), and the only
  files written are the outputs of the document the ledger names.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from db.documents import get_document
from db.models import DocStatus, Page, ReviewKind
from db.reviews import page_states, record_review
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.review.corrections import EditRefused, correct_page, model_reading
from ingest.review.rerun_queue import RerunQueue

TOKEN_HEADER = "x-uflash-token"


@dataclass
class Review:
    """What the server serves: the ledger, the settings (outputs, thresholds), the token and the queue of re-runs."""

    settings: Settings
    db: Database
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    hosts: frozenset[str] = frozenset()  # "host:port" values the Host header may take
    reruns: RerunQueue | None = None
    run_id: int | None = None  # the run shown without ?run= (the latest when the server started: re-runs queued from
    # the page make later runs, and a reload still shows the pages being reviewed)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one change at a time

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(f"http://{h}" for h in self.hosts)


def _refuse(status: int, why: str) -> JSONResponse:
    return JSONResponse({"error": why}, status_code=status)


class Guard:
    """The checks every request passes before it reaches a route (see the module)."""

    def __init__(self, app: Any, review: Review):
        self.app, self.review = app, review

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        refusal = self.check(request)
        if refusal is not None:
            logger.warning("review: refused {} {}: {}", request.method, request.url.path, refusal.body.decode())
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def check(self, request: Request) -> Response | None:
        r = self.review
        if request.headers.get("host", "") not in r.hosts:
            return _refuse(403, "this server answers only at the address it printed")
        given = request.query_params.get("token", "") if request.url.path == "/" else \
            request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), r.token.encode()):
            return _refuse(403, "no valid token: open the address `uflash review` printed")
        if request.method not in ("GET", "HEAD"):
            if request.headers.get("origin", "") not in r.origins:
                return _refuse(403, "a change must come from the review page itself (Origin)")
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return _refuse(415, "a change is sent as JSON")
        return None


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise EditRefused("the body must be a JSON object")
    return body


def build_app(review: Review) -> Starlette:
    from ingest.quality.calibration import grading_thresholds
    from ingest.review.page import reading_html, render_html
    from ingest.review.report import collect_report, report_images
    from ingest.worker.finish import Finisher

    unsure = grading_thresholds(review.settings).thresholds.unsure_word_prob
    config = str(review.settings.config_file.resolve()) if review.settings.config_file else None
    images: dict[int, dict[int, str]] = {}  # run id -> its page images (rendered once)

    def page_of(request: Request) -> Page:
        page = model_reading(review.db, request.path_params["page_id"])
        if page is None:
            raise LookupError("no such page")
        return page

    def reading(request: Request, page: Page, recorded: str | None = None) -> JSONResponse:
        state = page_states(review.db, [page.document_id]).get((page.document_id, page.page_index))
        c = state.correction if state else None
        p = {"page_id": request.path_params["page_id"], "text": page.text, "person_text": c.text if c else None,
             "word_confidence": (page.stats or {}).get("word_confidence")}
        return JSONResponse({"recorded": recorded, "corrected": c is not None, "cer": c.cer if c else None,
                             "checked": bool(state and state.checked), "text_html": reading_html(p, unsure)})

    def rewrite(page: Page) -> None:
        """The document's outputs written again from each page's reading."""
        Finisher(review.settings, review.db).finish(page.document_id)

    def changing(handler):  # noqa: ANN001, ANN202
        async def route(request: Request) -> Response:
            try:
                body = await _json(request)

                def locked() -> Response:
                    with review.lock:
                        page = page_of(request) if "page_id" in request.path_params else None
                        if page is not None and get_document(review.db, page.document_id).status != DocStatus.DONE:
                            return _refuse(409, "the document is not finished: correct it once it is done")
                        return handler(request, page, body)

                return await run_in_threadpool(locked)  # a rewrite of the outputs takes seconds: off the loop
            except EditRefused as e:
                return _refuse(400, str(e))
            except LookupError as e:
                return _refuse(404, str(e))
        return route

    def index(request: Request) -> Response:  # plain functions run in Starlette's thread pool
        run = request.query_params.get("run")
        if run is not None and not run.isdigit():
            return _refuse(400, "run: a run's id (a number)")
        rep = collect_report(review.db, int(run) if run else review.run_id)
        if rep["run"] is None:
            return HTMLResponse("<p>nothing decoded yet</p>")
        if rep["run"]["id"] not in images:
            images[rep["run"]["id"]] = report_images(rep)
        return HTMLResponse(render_html(rep, images[rep["run"]["id"]], config, unsure, token=review.token),
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    def correction(request: Request, page: Page, body: dict[str, Any]) -> Response:
        blocks = body.get("blocks")
        if not isinstance(blocks, dict) or not blocks or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, str) for k, v in blocks.items()):
            raise EditRefused("blocks: an object of block number -> its new text")
        kind, _ = correct_page(review.db, page, {int(k): v for k, v in blocks.items()})
        rewrite(page)
        return reading(request, page, kind.value)

    def undo(request: Request, page: Page, body: dict[str, Any]) -> Response:
        state = page_states(review.db, [page.document_id]).get((page.document_id, page.page_index))
        if state and state.correction:
            record_review(review.db, page, ReviewKind.UNDONE)
            rewrite(page)
        return reading(request, page, ReviewKind.UNDONE.value)

    def checked(request: Request, page: Page, body: dict[str, Any]) -> Response:
        if not isinstance(body.get("checked"), bool):
            raise EditRefused("checked: true or false")
        kind = ReviewKind.CHECKED if body["checked"] else ReviewKind.UNCHECKED
        record_review(review.db, page, kind)
        return reading(request, page, kind.value)

    def queue(request: Request, page: None, body: dict[str, Any]) -> Response:
        ids = body.get("pages")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in ids):
            raise EditRefused("pages: a list of page ids")
        with review.db.session() as s:
            found = {(p.document_id, p.page_index) for p in (s.get(Page, i) for i in ids) if p is not None}
        if len(found) == 0:
            raise LookupError("no such page")
        added = review.reruns.add(found)
        return JSONResponse({"queued": [a.what for a in added], "reruns": review.reruns.snapshot()})

    def reruns(request: Request) -> Response:
        return JSONResponse({"reruns": review.reruns.snapshot()})

    return Starlette(routes=[
        Route("/", index),
        Route("/api/pages/{page_id:int}/correction", changing(correction), methods=["POST"]),
        Route("/api/pages/{page_id:int}/undo", changing(undo), methods=["POST"]),
        Route("/api/pages/{page_id:int}/checked", changing(checked), methods=["POST"]),
        Route("/api/reruns", changing(queue), methods=["POST"]),
        Route("/api/reruns", reruns, methods=["GET"]),
    ])


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock


def serve(settings: Settings, db: Database, host: str = "127.0.0.1", port: int = 0, run_id: int | None = None,
          announce=print) -> None:  # noqa: ANN001
    """Serve the review page until Ctrl+C or SIGTERM; ``announce`` gets the address to open (with its token)."""
    import uvicorn

    from db.runs import get_run, latest_run_with_work

    if run_id is not None and get_run(db, run_id) is None:
        raise UsageError(f"no run {run_id}")
    sock = listen(host, port)
    port = sock.getsockname()[1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    names = {shown, host} | ({"localhost", "127.0.0.1"} if host in ("127.0.0.1", "0.0.0.0", "::") else set())
    review = Review(settings, db, hosts=frozenset(f"{n}:{port}" if ":" not in n else f"[{n}]:{port}" for n in names),
                    run_id=run_id if run_id is not None else latest_run_with_work(db))
    review.reruns = RerunQueue(settings.config_file, Path.cwd())
    app = Guard(build_app(review), review)
    netloc = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"
    announce(f"review  http://{netloc}/?token={review.token}")
    server = _stopping_server()(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        review.reruns.close()
        sock.close()


def _stopping_server():  # noqa: ANN202
    import uvicorn

    class StoppingServer(uvicorn.Server):
        """uvicorn's server, stopped by Ctrl+C or SIGTERM without raising the signal again once it has stopped (the
        command then ends as it should: the re-run in hand finished, exit code 0)."""

        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGBREAK] if hasattr(signal, "SIGBREAK") else [])
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return StoppingServer
