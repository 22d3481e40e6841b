"""Reads: how a source's records become batch rows - the records of one `rows` call
(`record_reads`) and the channels of a gridded timeline's files (`gridded_reads`).
"""
