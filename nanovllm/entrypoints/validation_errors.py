"""Pydantic's request validation errors as OpenAI's error body: the first few in one message, the
documented bounds in SamplingParams' words, an unknown field with the nearest known one suggested.
Used by the server's RequestValidationError handler (openai_server.py)."""
import difflib

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from nanovllm.entrypoints.protocol import error_body

_BOUND_WORDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def request_fields(request: Request) -> list[str]:
    """The field names of the body model of the route that refused a request ([] if it has none)."""
    route = request.scope.get("route")
    for param in getattr(getattr(route, "dependant", None), "body_params", []):
        fields = getattr(getattr(param.field_info, "annotation", None), "model_fields", None)
        if fields:
            return [info.alias or name for name, info in fields.items()]
    return []


def validation_body(e: RequestValidationError, known_fields: list[str] = ()) -> dict:
    """The first few pydantic errors as one message; param names the first bad field. An unknown
    field gets the nearest known one suggested ("temprature": did you mean "temperature"?)."""
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return error_body(f"request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
    messages, params = [], []
    for err in errors[:4]:
        field = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "model_attributes_type" and not field:
            messages.append("request body must be a JSON object (send Content-Type: application/json)")
        elif err.get("type") in _BOUND_WORDS:  # the documented bounds, in SamplingParams' words
            (bound,) = err["ctx"].values()
            messages.append(f"{field} must be {_BOUND_WORDS[err['type']]} {bound}, got {err.get('input')!r}")
        elif err.get("type") == "extra_forbidden" and field:
            near = difflib.get_close_matches(field, known_fields, n=1, cutoff=0.75)
            messages.append(f"{field}: unknown field" + (f"; did you mean {near[0]!r}?" if near else ""))
        else:
            messages.append(f"{field or 'request body'}: {err.get('msg')}")
        params.append(field or None)
    return error_body("; ".join(messages) or "invalid request", param=params[0] if params else None)


def first_error(e, where: str = "") -> tuple[str, str]:
    """(dotted field path under `where`, message) of a pydantic ValidationError's first error: the
    agent APIs' own checks of the chat request they translate a body into."""
    first = e.errors()[0]
    return ".".join(str(p) for p in (where, *first["loc"]) if p != ""), first["msg"]
