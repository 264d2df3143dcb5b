"""The dashboard's own code: the Streamlit frame every page shares and the pure chart functions
(DataFrame -> Altair). Pages in ``pages/`` stay thin on top of this and of the analysis layer."""
