"""Tests of nonstop/integrations/."""
