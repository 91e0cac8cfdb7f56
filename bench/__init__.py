"""`make bench` (`python -m bench`): figures as ratios against baselines measured in the same run.
A host-side tool like the tests: no image carries it, and the product packages never import it.

- rebuild with no change: the builder (checks, generation, mkosi) against plain mkosi given the
  same generated tree and options (target: at most 1.3x) (image.py);
- preloading a generated engine image of 2 GiB (cold) against a plain copy of the same bytes
  (target: at most 1.3x), and again with the cache warm (target: under 5 s) (image.py);
- `applianctl status`: median of 20 runs against the stand-in engine, healthy and hung (status.py);
- upgrades: the bytes a bundle ships when the engine digest is unchanged, against a full bundle
  whose engine partition image is a generated 2 GiB one (target: no engine bytes), and the time
  to write a /usr slot the appliance's way (blank the slot, then the image's own
  systemd-sysupdate with the shipped transfer definitions, on a loop device) against a plain
  copy of the same partition images (target: at most 1.3x) (upgrade.py);
- the lean boot path: the unified kernel image's size and the time from power-on (QEMU started,
  TCG) to a healthy engine (GET /health answering through the proxy), the demo image as built
  against the same image built with every module and firmware file in its initrd (mkosi's
  default, the "before") (image.py);
- the weights: fetch against curl, the check before every start against sha256sum (weights.py);
- installing the release onto a disk against `bmaptool copy` of the same image (install.py);
- engine slots: the time to write an engine store into a free engine slot the way an update
  writes it (blank the slot, then systemd-sysupdate's engine component) against
  `dd bs=4M conv=fsync` of the same bytes (target: at most 1.3x), slot A checked unchanged
  (engine.py); the sectors written to the running engine partition during an update are counted
  in the QEMU journey, where the partitions are real;
- a new engine's bytes in a bundle (what an appliance downloads) against its uncompressed
  partition image (upgrade.py).

BENCH_ONLY=name,name (the functions' names, e.g. bench_boot) runs only those.
"""
