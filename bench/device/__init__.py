"""One-device-call scripts: each runs the GPU tests and the timings of one piece of work in a single
call on the GPU machine (a fresh machine every time), every step under its own time limit, and writes
logs and a summary under $OUT. env.sh is what the shell scripts share (wheels, $PY, `say`)."""
