"""slots"""
