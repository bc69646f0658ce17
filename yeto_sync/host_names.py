"""Host names the resolver refuses before it is asked.

``socket.getaddrinfo`` encodes a name with IDNA first and raises ``UnicodeError``, not
``OSError``, for a label that is empty or over 63 characters (``a..b``) or a character IDNA
cannot encode: a typo that would escape the code meant for network failures as a traceback.
``yeto-sync --host`` and a learner's syncer address are checked with this up front instead.
"""

from __future__ import annotations


def host_name_problem(host: str) -> str | None:
    """Why ``host`` can never be resolved (one phrase), or None when the resolver may try it."""
    try:
        host.encode("idna")
    except UnicodeError as exc:
        reason = exc.__cause__ or exc  # the codec's own words: "label empty or too long"
        return f"not a valid host name: {reason}"
    return None
