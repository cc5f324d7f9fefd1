"""SGLang production path for hidden-state extraction.

- `patch`: apply/verify/revert the one-call insertion into SGLang's deepseek_v2.py.
- `location`: where an interpreter's SGLang is, without importing it (sent to that interpreter as source).
- `dump_hook`: what the patched SGLang calls; writes per-request chunk files.
- `server`: the server's lifecycle on the GPU host (command line, start, health wait, log, stop).
- `health`: the health checks the host's interpreter runs beside the server (sent as source).
- `driver`: sends a plan's shard to the server and stitches chunk files into the shard.
- `releases`: the supported releases' table (patches/sglang/releases.json).

Nothing here imports SGLang at module level: `dump_hook` runs inside it, the rest
talks to it over HTTP or through its interpreter.
"""
