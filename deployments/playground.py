"""The playground: a page the app serves at /playground (and / redirects to) that talks to the app's
own OpenAI API and shows what speculation does on a prompt (each token's origin, from `spec_trace`).

Three static files shipped in the package (deployments/playground/), read once: no CDN, no build
step, nothing fetched beyond the app. The page holds no secret: the API key is what the user types,
kept in the page's memory and sent as the Authorization header; the page itself is public (it is
not under PROTECTED), every API call it makes is not.
"""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from starlette.exceptions import HTTPException

ASSETS = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}

# No inline script or style, nothing from elsewhere: model text that got into the DOM as HTML
# still could not run; the page can't be framed or post forms anywhere.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    folder = files("deployments") / "playground"
    page = (folder / "index.html").read_bytes()
    assets = {name: ((folder / name).read_bytes(), kind) for name, kind in ASSETS.items()}

    @app.get("/", include_in_schema=False)
    async def root(request: Request):
        # under a Serve route_prefix the page is below it too
        return RedirectResponse(f"{request.scope.get('root_path', '')}/playground", status_code=307)

    @app.get("/playground", include_in_schema=False)
    async def playground():
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in assets:
            raise HTTPException(404)  # the app's own 404, in the API's error shape
        body, kind = assets[name]
        return Response(body, media_type=kind, headers=HEADERS)
