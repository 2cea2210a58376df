"""``GET /``: the playground, one self-contained page (``playground.html``: HTML, CSS and JavaScript,
no build step, no outside assets) that streams ``POST /generate`` into the browser and shows time to
first token and tokens/s. Registered on ``jaxray.serve.routes.api`` when imported. No Ray, no JAX."""

from importlib.resources import files

from fastapi.responses import HTMLResponse

from jaxray.serve.routes import api

PAGE = files("jaxray.serve").joinpath("playground.html").read_text(encoding="utf-8")


@api.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(PAGE)
