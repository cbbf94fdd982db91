#!/usr/bin/env bash
# Make a Debian bookworm base image from Debian's packages alone (for machines that reach a Debian
# mirror but no container registry): debootstrap a minimal system with Python, then `docker import`.
# Usage: scripts/docker_base.sh IMAGE[:TAG]   (root; needs debootstrap; MIRROR overrides the mirror)
# EXTRA_PACKAGES adds packages (e.g. python3-dev for a base that already has the Python headers).
set -euo pipefail
image=${1:?usage: $0 IMAGE[:TAG]}
mirror=${MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { echo "debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
pkgs="python3,python3-venv,python3-pip,ca-certificates${EXTRA_PACKAGES:+,$EXTRA_PACKAGES}"
debootstrap --variant=minbase --include="$pkgs" bookworm "$root" "$mirror"
tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$image"
echo "made base image $image"
