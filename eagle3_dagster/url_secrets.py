"""Whether a URL carries a credential, said without the secret: the profile refuses such a value in any field,
and `storage.location` refuses such a location wherever it comes from (the profile, the `eagle3` command line, a
plan). A leaf module, so that both can import it.

"""

from __future__ import annotations

import re
import urllib.parse

# A profile or a location is published (run metadata, the launchpad, reprs, logs), so it may carry no secret. A URL
# carries one as user:password@ before the host, or as a query parameter named like a key; the names below are
# the ones providers and stores use (OpenAI-style `api_key`, `key`, `token`, `access_token`, `auth`, presigned
# S3/GCS `X-Amz-Signature` / `X-Goog-Credential`, `sig`, `password`, `secret`, `session`).
_SECRET_PARAM = re.compile(r"key|token|secret|passw(?:or)?d|pwd|auth|credential|signature|^sig$|session", re.I)
# user:password@host also when the password holds an unescaped '/' (AWS secret keys often do), which URL
# parsers then read as the start of the path
_USER_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^@/?#]*:[^@]*@", re.I)


def url_credentials(value: str) -> str | None:
    """What in `value`, when it is a URL, is a credential ('user:password@', a `?api_key=`-style parameter), said
    without the secret; None for a URL without one or a value that is not a URL."""
    scheme, sep, _ = value.partition("://")
    if not sep:
        return None
    parts = urllib.parse.urlsplit(value)
    # an hf:// URL's '@' is a revision (hf://org/repo@main), an ssh:// URL's a user name, neither a secret
    if ("@" in parts.netloc and scheme.lower() not in ("hf", "ssh")) or _USER_PASSWORD.match(value):
        return "a user name or password before the host (user:password@; an '@' in a path is written %40)"
    names = [
        name
        for text in (parts.query, parts.fragment)
        for name, _ in urllib.parse.parse_qsl(text, keep_blank_values=True)
    ]
    if secret := [n for n in names if _SECRET_PARAM.search(n)]:
        return f"a query parameter named {secret[0]!r}"
    return None
