# SPDX-License-Identifier: MIT
"""`make bench` (`python -m bench`): figures as ratios against baselines measured in the same run.
A host-side tool like the tests: no image carries it.

- image.py: a no-change rebuild against plain mkosi on the same tree (target: at most 1.3x);
  preloading a 2 GiB engine image, cold against a plain copy (at most 1.3x) and warm (under 5 s);
  the kernel image's size and power-on to a healthy engine through the proxy (QEMU, TCG) against
  the same image with mkosi's default full initrd;
- status.py: `applianctl status`, median of 20 runs, the stand-in engine healthy and hung;
- upgrade.py: a bundle's bytes with the engine unchanged (target: no engine bytes), a new engine's
  bundle bytes against its partition image, and writing a /usr slot the appliance's way (blank it,
  then systemd-sysupdate) against a plain copy (at most 1.3x);
- weights.py: fetch against curl, the check before every start against sha256sum;
- install.py: installing the release onto a disk against `bmaptool copy`;
- engine.py: writing an engine slot as an update does against `dd` (at most 1.3x).

BENCH_ONLY=name,name (the functions' names, e.g. bench_boot) runs only those.
"""
