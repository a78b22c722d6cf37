"""zspeed.train"""
