"""The installer: runs from RAM on the installer medium (never on the appliance itself), picks
exactly one disk the signed install plan names, and writes the release onto it."""
