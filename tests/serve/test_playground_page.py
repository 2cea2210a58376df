"""``GET /`` without a server: the playground page is package data, registered on the app outside
its OpenAPI schema, holds the elements the browser test drives, and loads nothing from elsewhere."""

from __future__ import annotations

import asyncio
import re

from jaxray.serve.routes import PAGE, api, playground

IDS = ("prompt", "temperature", "top_k", "max_tokens", "seed", "generate", "output", "ttft", "tps", "error")


def test_get_slash_answers_the_page():
    [route] = [r for r in api.routes if getattr(r, "path", None) == "/"]
    assert route.methods == {"GET"} and not route.include_in_schema
    response = asyncio.run(playground())
    assert response.status_code == 200 and response.media_type == "text/html"
    assert response.body.decode() == PAGE


def test_the_page_is_self_contained_and_has_its_controls():
    page = PAGE
    for name in IDS:
        assert f'id="{name}"' in page, name
    assert ">ROMEO:</textarea>" in page and 'fetch("generate"' in page
    # No outside assets: no src/href but a data: URI (the empty favicon), no CSS import or url(), no
    # absolute URL.
    assert not re.search(r'\b(src|href)\s*=\s*"(?!data:)|@import|url\(|https?://', page, re.IGNORECASE)
