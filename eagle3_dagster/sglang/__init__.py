"""SGLang production path for hidden-state extraction.

- `patch`: apply/verify/revert the one-call insertion into SGLang's deepseek_v2.py.
- `dump_hook`: what the patched SGLang calls; writes per-request chunk files.
- `driver`: sends samples to the server and stitches chunk files into shards.

Nothing here imports SGLang at module level: `dump_hook` runs inside it, the rest
talks to it over HTTP or through its interpreter.
"""
