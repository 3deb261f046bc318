"""The EAGLE-3 drafts shipped with specjax, as package data (one directory per draft)."""
