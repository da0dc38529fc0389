# Helpers shared by the service scripts (sourced, not run): messages, timing, ports, Debian packages,
# PostgreSQL's binaries and OS user. The sourcing script sets PROG (its name, for messages) first.
# shellcheck shell=bash

PATH="$PATH:/usr/sbin:/sbin"   # start-stop-daemon, runuser and pgbouncer, also for non-root users

say() { printf '%s\n' "$*"; }
warn() { printf '%s: warning: %s\n' "${PROG:-services}" "$*" >&2; }
die() { printf '%s: error: %s\n' "${PROG:-services}" "$*" >&2; exit 1; }

# since T0: the time elapsed since T0 (an $EPOCHREALTIME), e.g. 1.2s
since() {
    local us=$((${EPOCHREALTIME/[.,]/} - ${1/[.,]/}))
    printf '%d.%ds' $((us / 1000000)) $((us / 100000 % 10))
}

# port_answers HOST PORT: something accepts TCP connections there
port_answers() { timeout 2 bash -c ">/dev/tcp/$1/$2" 2>/dev/null; }

# apt_install PACKAGE...: install Debian packages (root only), without letting their install scripts start
# Debian's default instances (no systemd here: they would take the standard ports)
APT_UPDATED=0
apt_install() {
    [[ $EUID -eq 0 ]] || die "need to install $*, which requires root (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    say "installing $* ..."
    if [[ $APT_UPDATED -eq 0 ]]; then
        apt-get update -qq
        APT_UPDATED=1
    fi
    local added_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        added_policy=1
    fi
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    if [[ $added_policy -eq 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi
}

# pg_bin TOOL: TOOL of the newest installed PostgreSQL (Debian keeps initdb and pg_ctl off the PATH)
pg_bin() {
    local dirs=(/usr/lib/postgresql/*/bin)
    printf '%s/%s\n' "$(printf '%s\n' "${dirs[@]}" | sort -V | tail -n1)" "$1"
}

# as_pg CMD...: run CMD as the postgres OS user when root (initdb, the server and pgbouncer refuse root)
as_pg() {
    if [[ $EUID -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# grant_traversal DIR: let the postgres OS user reach DIR (o+x on each ancestor it cannot traverse, e.g. a
# clone under /root, which is mode 700); root only
grant_traversal() {
    [[ $EUID -eq 0 ]] || return 0
    runuser -u postgres -- test -x "$1" && return 0
    local dir="" part parts
    IFS=/ read -r -a parts <<<"${1#/}"
    for part in "${parts[@]}"; do   # top-down, so that each check sees only one new level
        dir+="/$part"
        if ! runuser -u postgres -- test -x "$dir"; then
            warn "granting o+x on $dir so that the postgres user can reach $1"
            chmod o+x "$dir"
        fi
    done
}
