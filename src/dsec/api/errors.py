"""The ONE place where errors become HTTP responses: ``{code, message, details}``.

``dsec.errors.DSecError`` subclasses carry their status; request-validation errors
become 422 naming the field; unknown routes 404; anything unexpected a 500 whose
message says where to look (server log), never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.errors import DSecError, InvalidArgument

log = logging.getLogger("dsec.api")

_STATUS_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                 413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_argument"}


def error_response(err: DSecError, retry_after_default: float) -> JSONResponse:
    headers: dict[str, str] = {}
    if err.http_status in (429, 503):
        ra = err.details.get("retry_after", retry_after_default)
        headers["Retry-After"] = str(max(1, int(float(ra) + 0.999)))
    return JSONResponse(err.to_dict(), status_code=err.http_status, headers=headers)


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or ".".join(str(p) for p in loc)


def validation_error(errors: list[dict[str, Any]]) -> InvalidArgument:
    fields = [{"field": _field_name(e.get("loc", ())), "error": e.get("msg", "")} for e in errors]
    summary = "; ".join(f"{f['field']}: {f['error']}" for f in fields[:5])
    return InvalidArgument(f"invalid request: {summary}. Fix these fields and retry.", fields=fields)


def install_error_handlers(app: FastAPI, retry_after_default: float) -> None:
    @app.exception_handler(DSecError)
    async def _dsec(_: Request, err: DSecError) -> JSONResponse:
        return error_response(err, retry_after_default)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(err.errors())), retry_after_default)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(err.status_code, "http_error")
        msg = str(err.detail)
        if err.status_code == 404 and msg == "Not Found":
            msg = f"no such endpoint {request.method} {request.url.path}: see /docs for the API"
        elif err.status_code == 405:
            msg = f"method {request.method} not allowed on {request.url.path}: see /docs for the API"
        return JSONResponse({"code": code, "message": msg, "details": {}}, status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"code": "internal", "message": f"internal error ({type(err).__name__}); "
                             "see the server log for details", "details": {}}, status_code=500)
