"""draft_service: see DESIGN.md section 2. Built in later issues."""
