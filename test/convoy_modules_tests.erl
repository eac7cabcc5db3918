%% convoy's modules call each other without cycles, so each can be read and changed
%% knowing only what it calls.
-module(convoy_modules_tests).

-include_lib("eunit/include/eunit.hrl").

no_module_cycles_test() ->
    ?assertEqual([], [lists:sort(C) || C <- module_cycles()]).

%% Strongly connected groups of convoy's modules (calls between modules, from
%% the compiled application).
module_cycles() ->
    {ok, X} = xref:start([{xref_mode, modules}]),
    try
        {ok, _} = xref:add_directory(X, filename:dirname(code:which(convoy))),
        {ok, Edges} = xref:q(X, "ME || AM"),
        G = digraph:new(),
        [begin
             digraph:add_vertex(G, A),
             digraph:add_vertex(G, B),
             digraph:add_edge(G, A, B)
         end || {A, B} <- Edges, A =/= B],
        [C || C <- digraph_utils:strong_components(G), length(C) > 1]
    after
        xref:stop(X)
    end.
