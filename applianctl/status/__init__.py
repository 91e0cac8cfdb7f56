"""`applianctl status`: one probe per part, all under one deadline."""
