"""The admin's own pages beyond the model admins: the live overview and the timeline."""
