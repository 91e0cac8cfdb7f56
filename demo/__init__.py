"""What only the demo and test images carry: the boot check that reports to a test host and acts
on its plans. builder/render.py installs this package for the demo profile only."""
