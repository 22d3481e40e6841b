"""Time and CF conventions: calendars on one numpy time axis (`calendars`), CF decoding as xarray
does it (`cf_decode`), the files of a gridded data set as one timeline (`gridded_timeline`),
splits by time ranges (`time_splits`), variables and levels as channels (`channels`).
"""
