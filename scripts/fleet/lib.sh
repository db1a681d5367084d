# Shell functions the fleet benchmarks share (sourced by scripts/bench-fleet and
# scripts/fleet/bench-routers).

# A free local port.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Sums metric NAME over the servers at URLS.
metric() {
    local name=$1 total=0 v
    shift
    for url in "$@"; do
        v=$(curl -s "$url/metrics" | sed -n "s/^pensieve_${name} //p")
        total=$(python3 -c "print(${total} + ${v:-0})")
    done
    echo "$total"
}
